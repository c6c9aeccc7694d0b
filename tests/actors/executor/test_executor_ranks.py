"""The executor as two tensor-parallel ranks, each a process of its own (gloo on the CPU, NCCL on
two GPUs), meeting the scheduler on a real nats-server: on every cache path (GPU hits, swap-ins,
recomputation of dropped chunks) the tokens are those of one rank re-prefilling every turn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from pensieve.actors.config import Policy, SchedulerConfig
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.remote_runner import ExecutorLost, connect_executor
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.step import SamplingParams, StepRunner, SwapStats
from pensieve.models.loader import load_model
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.executor_ranks import ExecutorRanks, RankSpec
from pensieve.ops.factory import DTYPES, cache_config
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.store import ConversationStore
from tests.actors.scheduler.test_remote_runner import converse

OPTIONS = EngineOptions(
    model="preset:tiny-llama",
    gpu_cache_tokens=320,
    cpu_cache_tokens=320,
    max_batch_tokens=256,
    cpu_threads=1,
    tensor_parallel=2,
)


def engine(options: EngineOptions, runner: StepRunner) -> Engine:
    """An engine with `options`' tiers around `runner` (no tokenizer: the tests speak tokens,
    and a GPU machine has no SmolLM2 to borrow one from)."""
    dtype = DTYPES[options.dtype]
    config = load_model(options.model, "meta", dtype).config
    cache = cache_config(options, config, torch.device("cpu"), dtype)
    scheduling = SchedulerConfig(
        options.max_batch_tokens, options.max_num_seqs, config.max_context_len
    )
    cost = lambda context: 1.0 + context / 512  # noqa: E731
    return Engine(runner, cache, scheduling, cost, frozenset(), overlap=options.overlap)


def one_rank(options: EngineOptions) -> Engine:
    device = torch.device(options.device)
    loaded = load_model(options.model, device, DTYPES[options.dtype], seed=options.seed)
    cache = cache_config(options, loaded.config, device, DTYPES[options.dtype])
    return engine(options, ModelRunner(loaded.model, cache, device, DTYPES[options.dtype]))


@contextlib.asynccontextmanager
async def ranks_engine(
    options: EngineOptions, data_dir: Path
) -> AsyncIterator[tuple[Engine, ExecutorRanks]]:
    """An engine whose executor is `options.tensor_parallel` rank processes, met over a real
    nats-server."""
    with EmbeddedNats() as nats, ExecutorRanks(RankSpec(options, nats.url, data_dir)) as ranks:
        assert await asyncio.to_thread(ranks.wait_ready, 300), ranks.failed
        with ConversationStore(data_dir) as store:
            engine_id = store.engine_id()
        bus = await Bus.connect(nats.url)
        runner = await connect_executor(bus, engine_id, timeout_s=30)
        try:
            yield engine(options, runner), ranks
        finally:
            await runner.close()
            await bus.close()


def reference(options: EngineOptions) -> list[list[int]]:
    """The tokens of one rank that re-prefills every turn."""
    one = dataclasses.replace(options, tensor_parallel=1, policy=Policy.STATELESS)
    return converse(one_rank(one))[0]


def test_two_executor_ranks_give_the_stateless_tokens_on_every_cache_path(tmp_path: Path) -> None:
    async def run() -> tuple[list[list[int]], dict[str, int], SwapStats]:
        async with ranks_engine(OPTIONS, tmp_path) as (engine, _):
            outputs, sources = await asyncio.to_thread(converse, engine)
            return outputs, sources, engine.swap_stats()

    outputs, sources, swaps = asyncio.run(run())
    assert sources["gpu"] and sources["cpu"] and sources["recomputed"], sources
    assert outputs == reference(OPTIONS)
    # the bytes of both ranks' shares: whole blocks of K and V, every layer
    config = load_model(OPTIONS.model, "meta", torch.float32).config
    block = OPTIONS.block_size * config.kv_bytes_per_token(torch.float32)
    assert swaps.blocks_in and swaps.bytes_in == swaps.blocks_in * block


def suspend(engine: Engine) -> tuple[list[list[int]], int]:
    """Two requests that fit when admitted but not once grown: the later one is suspended
    (swapped out to the CPU tier and requeued), then runs to its end."""
    sampling = SamplingParams(max_tokens=96, ignore_eos=True)
    prompts = [[(11 * i + k) % 400 + 5 for k in range(60)] for i in range(2)]
    requests = [engine.add_request(f"s{i}", p, sampling) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [list(r.output_ids) for r in requests], engine.scheduler.num_suspensions


TIGHT = dataclasses.replace(
    OPTIONS, gpu_cache_tokens=224, cpu_cache_tokens=1024, admission_reserve=0.0
)


def test_a_request_suspended_on_two_ranks_keeps_its_tokens(tmp_path: Path) -> None:
    async def run() -> tuple[list[list[int]], int]:
        async with ranks_engine(TIGHT, tmp_path) as (engine, _):
            return await asyncio.to_thread(suspend, engine)

    outputs, suspensions = asyncio.run(run())
    assert suspensions > 0
    roomy = dataclasses.replace(
        TIGHT, tensor_parallel=1, gpu_cache_tokens=4096, policy=Policy.STATELESS
    )
    assert outputs == suspend(one_rank(roomy))[0]


def test_a_dead_rank_is_a_dead_executor(tmp_path: Path) -> None:
    """Killing one rank fails the step in flight (no wait for ever); all ranks start again
    holding no KV, and once the engine has forgotten its KV the turns give the same tokens."""

    async def run() -> tuple[str, list[list[int]]]:
        async with ranks_engine(OPTIONS, tmp_path) as (engine, ranks):
            os.kill(ranks.pids()[1], signal.SIGKILL)
            with pytest.raises((ExecutorLost, RuntimeError)) as lost:
                await asyncio.to_thread(converse, engine)
            while ranks.generation < 2:
                await asyncio.sleep(0.1)
            assert await asyncio.to_thread(ranks.wait_ready, 300), ranks.failed
            await asyncio.to_thread(engine.abort_all, str(lost.value))  # as the engine thread does
            return str(lost.value), (await asyncio.to_thread(converse, engine))[0]

    error, outputs = asyncio.run(run())
    assert error
    assert outputs == reference(OPTIONS)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_two_executor_ranks_give_the_one_rank_tokens_on_every_cache_path(
    tmp_path: Path,
) -> None:
    options = dataclasses.replace(OPTIONS, device="cuda", cpu_threads=None)
    tight = dataclasses.replace(TIGHT, device="cuda", cpu_threads=None)
    for folder in ("paths", "suspension"):
        (tmp_path / folder).mkdir()

    async def run() -> tuple[list[list[int]], dict[str, int], tuple[list[list[int]], int]]:
        async with ranks_engine(options, tmp_path / "paths") as (engine, _):
            outputs, sources = await asyncio.to_thread(converse, engine)
        async with ranks_engine(tight, tmp_path / "suspension") as (engine, _):
            return outputs, sources, await asyncio.to_thread(suspend, engine)

    outputs, sources, (suspended, suspensions) = asyncio.run(run())
    assert sources["gpu"] and sources["cpu"] and sources["recomputed"], sources
    assert outputs == reference(options)
    assert suspensions > 0
    roomy = dataclasses.replace(
        tight, tensor_parallel=1, gpu_cache_tokens=4096, policy=Policy.STATELESS
    )
    assert suspended == suspend(one_rank(roomy))[0]
