"""The per-step channel across a real nats-server: an engine whose executor is an actor gives
the tokens of the in-process engine on every cache path, and a lost or unreadable plan fails
its step instead of being waited for."""

from __future__ import annotations

import asyncio
import dataclasses

from pensieve.actors.executor.actor import ExecutorActor
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.remote_runner import ExecutorLost, connect_executor
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.step import SeqPiece, StepPlan
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import build
from pensieve.ops.nats_server import EmbeddedNats
from tests.actors.wire.test_step_codec import GREEDY, plans

OPTIONS = EngineOptions(
    model="preset:tiny-llama", gpu_cache_tokens=320, cpu_cache_tokens=320, max_batch_tokens=256
)
NUM_CONVS, NUM_TURNS = 5, 3


def converse(
    engine: Engine, reasons: list[str] | None = None
) -> tuple[list[list[int]], dict[str, int]]:
    """Five conversations of three turns, all turns of a round at once, on tiers so small that
    histories swap out, come back and are dropped and recomputed (also run on executor ranks,
    tests/actors/executor/test_executor_ranks.py)."""
    histories: dict[str, list[int]] = {f"c{i}": [] for i in range(NUM_CONVS)}
    outputs = []
    for turn in range(NUM_TURNS):
        for i, (conv, history) in enumerate(histories.items()):
            message = [(13 * i + 7 * turn + k) % 400 + 5 for k in range(40 + 9 * i)]
            engine.add_request(conv, history + message, GREEDY)
        done = 0
        while done < NUM_CONVS:
            for request in engine.step().finished:
                histories[request.conv_id] = request.all_ids
                outputs.append(request.output_ids)
                if reasons is not None:  # what a failure shows: how each turn ended
                    reasons.append(
                        f"{request.conv_id}/{turn}: {request.finish_reason} "
                        f"after {len(request.output_ids)}"
                    )
                done += 1
    sources = dataclasses.asdict(engine.totals.sources)
    return sorted(outputs), sources


def test_an_engine_with_its_executor_over_nats_gives_the_in_process_tokens() -> None:
    local_reasons: list[str] = []
    expected, sources = converse(build(OPTIONS).engine, local_reasons)
    assert sources["cpu"] and sources["recomputed"], sources  # every cache path was taken
    remote_reasons: list[str] = []

    async def remote() -> tuple[list[list[int]], dict[str, int]]:
        built = build(OPTIONS)
        with EmbeddedNats() as nats:
            executor = ExecutorActor(await Bus.connect(nats.url), "e1", built.engine.runner)
            async with executor:
                bus = await Bus.connect(nats.url)
                runner = await connect_executor(bus, "e1", timeout_s=10)
                built.engine.runner = runner
                try:
                    return await asyncio.to_thread(converse, built.engine, remote_reasons)
                finally:
                    await runner.close()
                    await bus.close()

    got, remote_sources = asyncio.run(remote())
    assert got == expected, (local_reasons, remote_reasons, sources, remote_sources)
    # which chunks are evicted depends on idle times, so only the totals must agree
    assert sum(remote_sources.values()) == sum(sources.values())
    assert remote_sources["cpu"] and remote_sources["recomputed"], remote_sources


def test_the_scheduler_waits_for_an_executor_that_starts_later() -> None:
    async def late() -> int:
        built = build(OPTIONS)
        with EmbeddedNats() as nats:
            bus = await Bus.connect(nats.url)
            asking = asyncio.create_task(connect_executor(bus, "e2", timeout_s=20))
            await asyncio.sleep(1.0)
            assert not asking.done()
            async with ExecutorActor(await Bus.connect(nats.url), "e2", built.engine.runner):
                runner = await asking
                await runner.close()
            await bus.close()
            return runner.block_bytes

    assert asyncio.run(late()) == build(OPTIONS).engine.block_bytes


def test_a_plan_the_executor_cannot_read_fails_the_steps_in_flight() -> None:
    """Which step an unreadable plan was is unknown: every step in flight fails, so the engine
    resets instead of waiting for an answer that never comes."""

    async def unreadable() -> str:
        built = build(OPTIONS)
        with EmbeddedNats() as nats:
            async with ExecutorActor(await Bus.connect(nats.url), "e3", built.engine.runner):
                bus = await Bus.connect(nats.url)
                runner = await connect_executor(bus, "e3", timeout_s=10)
                # the plan leaves as a message without its pieces
                runner.encoder.encode = lambda *_: b'{"v": 1, "kind": "step"}'  # type: ignore[method-assign]
                launched = runner.launch(plans()[0])
                try:
                    await asyncio.to_thread(launched.result)
                except RuntimeError as error:
                    return str(error)
                finally:
                    await runner.close()
                    await bus.close()
        return "answered"

    assert "could not be read" in asyncio.run(unreadable())


def test_a_plan_with_nothing_to_compute_or_copy_is_sent_once() -> None:
    """The engine steps while a turn waits for its disk read: the first empty plan goes (the
    executor learns that the requests before it left, and ends their traces), the others stay
    here, and the request that goes on after them still computes right."""

    async def idle() -> tuple[int, list[int], list[int]]:
        built = build(OPTIONS)
        with EmbeddedNats() as nats:
            executor = ExecutorActor(await Bus.connect(nats.url), "e6", built.engine.runner)
            async with executor:
                bus = await Bus.connect(nats.url)
                runner = await connect_executor(bus, "e6", timeout_s=10)
                try:
                    opening = StepPlan((SeqPiece("a", (5, 6, 7), 0, 3, (0,), GREEDY),))
                    first = await asyncio.to_thread(runner.launch(opening).result)
                    empties = [runner.launch(StepPlan(())) for _ in range(100)]
                    results = await asyncio.to_thread(lambda: [e.result() for e in empties])
                    assert results == [[]] * len(empties)
                    # "a" goes on in its block: sent as a diff of the table the executor holds
                    going_on = StepPlan((SeqPiece("a", (first[0],), 3, 4, (0,), GREEDY, 1),))
                    tokens = await asyncio.to_thread(runner.launch(going_on).result)
                    return executor.last_step, first, tokens
                finally:
                    await runner.close()
                    await bus.close()

    last_step, first, tokens = asyncio.run(idle())
    assert last_step == 3 and len(first) == 1 and len(tokens) == 1


def test_a_plan_lost_on_the_way_is_noticed_instead_of_waited_for() -> None:
    """A message lost while NATS restarts: the executor says it never got the step, and the
    step fails (the engine then resets) rather than waiting forever."""

    async def lost() -> str:
        built = build(OPTIONS)
        with EmbeddedNats() as nats:
            async with ExecutorActor(await Bus.connect(nats.url), "e4", built.engine.runner):
                bus = await Bus.connect(nats.url)
                runner = await connect_executor(bus, "e4", timeout_s=10)
                runner.check_every_s = 0.2
                runner._post = lambda body: None  # type: ignore[method-assign]
                launched = runner.launch(plans()[0])
                try:
                    await asyncio.to_thread(launched.result)
                except ExecutorLost as error:
                    return str(error)
                finally:
                    await runner.close()
                    await bus.close()
        return "answered"

    assert "never reached the executor" in asyncio.run(lost())


def test_a_plan_late_on_the_way_is_waited_for_not_taken_for_lost() -> None:
    """A plan still on its way when the step is first checked (a loaded host): the executor
    has not seen it yet, but one check is not enough to call it lost; it is answered."""

    async def late() -> str:
        built = build(OPTIONS)
        with EmbeddedNats() as nats:
            async with ExecutorActor(await Bus.connect(nats.url), "e5", built.engine.runner):
                bus = await Bus.connect(nats.url)
                runner = await connect_executor(bus, "e5", timeout_s=10)
                runner.check_every_s = 0.2
                post, loop = runner._post, asyncio.get_running_loop()
                # held back 0.3 s: past the first check, before the second
                runner._post = lambda body: loop.call_soon_threadsafe(  # type: ignore[method-assign]
                    loop.call_later, 0.3, post, body
                )
                plan = StepPlan((SeqPiece("a", (1, 2, 3), 0, 3, (0,), GREEDY),))
                launched = runner.launch(plan)
                try:
                    tokens = await asyncio.to_thread(launched.result)
                except ExecutorLost as error:
                    return str(error)
                finally:
                    await runner.close()
                    await bus.close()
        return f"answered {len(tokens)}"

    assert asyncio.run(late()).startswith("answered")
