"""The disk tier with the executor in an actor of its own, across a real nats-server: the engine
asks the executor's tier through `RemoteDisk` (reads, the keys on disk, a clean stop's
write-back) and orders its saves, removals and loads through the step channel. The real SmolLM2
on the CPU and real files in `tmp_path`, as in `test_disk_tier_serving.py`: the greedy tokens
are those of tiers that hold everything, histories pushed off the GPU and CPU tiers come back
from disk, and after a clean stop of both actors a new executor and scheduler on the same
directory read the histories back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from pensieve.actors.executor.actor import ExecutorActor
from pensieve.actors.scheduler.remote_disk import RemoteDisk
from pensieve.actors.scheduler.remote_runner import connect_executor
from pensieve.actors.wire.bus import Bus
from pensieve.ops.context import write_back
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble_remote, model_runner
from pensieve.ops.nats_server import EmbeddedNats
from tests.actors.scheduler import test_disk_tier_serving as serving
from tests.actors.scheduler.test_disk_tier_serving import (
    BLOCK,
    FAST_DISK,
    LATE,
    NEXT,
    OPENINGS,
    ROOMY,
    TINY,
    Run,
    conversations,
)

# the run on roomy tiers, as the in-process tests have it (the model and its chat tokenizer
# come from tests/actors/conftest.py)
roomy = serving.roomy

pytestmark = pytest.mark.slow

_T = TypeVar("_T")


def options(tiers: dict, disk: Path | None) -> EngineOptions:
    return EngineOptions(
        model="smollm2",
        max_batch_tokens=512,
        disk_cache_dir=None if disk is None else str(disk),
        disk_cache_gb=None if disk is None else 0.1,
        disk_read_gbps=FAST_DISK,
        **tiers,
    )


@contextlib.asynccontextmanager
async def split_engine(url: str, smollm2, chat, tiers: dict, disk: Path) -> AsyncIterator[Run]:
    """An executor actor holding the model and the disk tier in `disk`, and an engine that
    steps it over NATS, built as a scheduler of its own process builds it (no disk options:
    it learns of the tier from the executor). Both stop cleanly on leaving: the scheduler
    writes the KV tiers back, the executor closes its tier."""
    runner = model_runner(options(tiers, disk), smollm2)
    assert runner.disk is not None
    try:
        async with ExecutorActor(await Bus.connect(url), "e1", runner):
            bus = await Bus.connect(url)
            remote = await connect_executor(bus, "e1", timeout_s=10)
            try:
                built = assemble_remote(options(tiers, None), smollm2, chat, remote)
                assert isinstance(built.engine.disk, RemoteDisk)
                yield Run(built.engine, chat)
                await asyncio.to_thread(write_back, built)
            finally:
                await remote.close()
                await bus.close()
    finally:
        await asyncio.to_thread(runner.disk.close)


async def off_loop(fn: Callable[[], _T]) -> _T:
    """`fn` on a thread of its own, as the engine's thread runs it: the bus's loop goes on."""
    return await asyncio.to_thread(fn)


def test_greedy_tokens_are_the_same_with_the_disk_tier_in_the_executor_actor(
    smollm2, chat, roomy, tmp_path
) -> None:
    async def split() -> Run:
        with EmbeddedNats() as server:
            async with split_engine(server.url, smollm2, chat, TINY, tmp_path) as run:
                return await off_loop(lambda: conversations(run))

    on_disk = asyncio.run(split())
    assert on_disk.outputs() == roomy.outputs()
    # the second turns' histories came back from the executor's disk tier
    sources = on_disk.sources()
    assert sources.disk >= 4 * BLOCK, sources
    assert on_disk.engine.stats()["tokens"]["prompt_sources"]["disk"] == sources.disk


def test_a_restarted_executor_and_scheduler_read_the_history_from_disk(
    smollm2, chat, roomy, tmp_path
) -> None:
    reference = roomy.outputs()

    async def first_turns(url: str) -> Run:
        async with split_engine(url, smollm2, chat, ROOMY, tmp_path) as run:

            def turns() -> Run:
                for conv_id, text in OPENINGS.items():
                    run.turn(conv_id, text)
                return run

            return await off_loop(turns)  # written back as the engine stops

    async def restarted(url: str, before: Run) -> Run:
        async with split_engine(url, smollm2, chat, ROOMY, tmp_path) as run:

            def turns() -> Run:
                for conv_id, log in before.logs.items():  # known from their token logs only
                    run.engine.restore(conv_id, log)
                    run.logs[conv_id] = log
                run.turn(*LATE)
                for conv_id, text in NEXT.items():
                    run.turn(conv_id, text)
                return run

            return await off_loop(turns)

    async def both() -> tuple[Run, Run]:
        with EmbeddedNats() as server:
            before = await first_turns(server.url)
            return before, await restarted(server.url, before)

    before, after = asyncio.run(both())
    assert before.outputs() + after.outputs() == reference
    history = sum(len(log) - 1 for log in before.logs.values())
    assert after.sources().disk >= history // BLOCK * BLOCK - 3 * BLOCK, after.sources()
    late = after.turns[0].sources
    assert late.disk >= 3 * BLOCK and late.new < BLOCK, late  # all of a's full chunks, by key
