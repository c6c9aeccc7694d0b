"""The engine thread's log of its slowest step intervals (`actors/scheduler/step_log.py`)."""

from __future__ import annotations

import asyncio
import time

from pensieve.actors.scheduler import step_log
from pensieve.actors.scheduler.actor import watching_loop
from pensieve.actors.scheduler.step_log import StepLog
from pensieve.actors.scheduler.step_timing import StepTiming
from pensieve.ops.load import slowest_between

TIMING = StepTiming(0.001, 0.002, 0.0, 0.01, 0.001, 3, 64, 2, 0, 0, 300)


def test_an_interval_counts_the_calls_before_its_step_and_not_an_idle_sleep() -> None:
    log = StepLog()
    time.sleep(0.5)  # asleep on the queue
    log.idle()
    log.command("add_request", 0.02)
    log.command("restore", 0.03)
    log.snapshot(0.004)
    time.sleep(0.01)  # the calls' and the step's time
    log.stepped(0.001, TIMING)
    (only,) = log.stats()["slowest"]
    assert 0.01 <= only["interval_s"] < 0.4  # the sleep before the calls is not in it
    assert only["between"] == {
        "commands": 2,
        "commands_s": 0.05,
        "slowest_command": "restore",
        "slowest_command_s": 0.03,
        "snapshot_s": 0.004,
    }
    assert only["phases"]["kind"] == "mixed+in" and only["phases"]["prefill_tokens"] == 64
    log.stepped(0.001, None)  # the next interval starts with nothing before it
    assert log.stats()["slowest"][-1]["between"]["commands"] == 0


def test_each_window_keeps_its_longest_and_a_read_takes_those_after_it(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(step_log.time, "monotonic", lambda: clock[0])
    log = StepLog(keep=2)

    def intervals(steps: list[dict]) -> list[float]:
        return [round(s["interval_s"], 6) for s in steps]

    def step(seconds: float) -> None:
        clock[0] += seconds
        log.stepped(seconds, None)

    for seconds in (0.5, 0.01, 0.02, 0.03):  # a slow warm-up step, then short ones
        step(seconds)
    before = log.stats()
    clock[0] += step_log.WINDOW_S  # the load starts in a window of its own
    log.idle()
    for seconds in (0.02, 0.09, 0.01, 0.05, 0.04):
        step(seconds)
    after = log.stats()
    assert intervals(after["slowest"]) == [0.5, 0.09, 0.05, 0.03]
    assert intervals(slowest_between(before, after)) == [0.09, 0.05]
    clock[0] += step_log.WINDOW_S * step_log.WINDOWS  # old windows are let go
    log.idle()
    step(0.001)
    assert intervals(log.stats()["slowest"]) == [0.001]


def test_a_blocked_event_loop_shows_as_a_stall_of_about_its_length() -> None:
    log = StepLog()

    async def go() -> None:
        async with watching_loop(log, tick_s=0.005):
            await asyncio.sleep(0.05)
            time.sleep(0.2)  # something holds the loop
            await asyncio.sleep(0.05)

    asyncio.run(go())
    stalls = log.stats()["loop_stalls"]
    assert 0.18 <= stalls[0]["lag_s"] < 1.0
    assert all(s["lag_s"] < 0.1 for s in stalls[1:])


def test_a_step_names_the_kernels_compiled_while_it_ran() -> None:
    """A compile of the process's Triton log that began within a step's interval is listed
    with that step, and no other."""
    from pensieve.kernels.compile_log import CompileEvent

    log, events = StepLog(), []
    log.watch_compiles(events)
    log.stepped(0.001, TIMING)
    time.sleep(0.01)
    events.append(CompileEvent("paged_attention", time.perf_counter(), 1.2, "x"))
    time.sleep(0.02)
    log.stepped(0.03, TIMING)
    time.sleep(0.01)
    log.stepped(0.001, TIMING)
    compiled = [s["compiled"] for s in log.stats()["slowest"]]
    assert compiled[0] == [{"kernel": "paged_attention", "s": 1.2, "variant": "x"}]
    assert compiled[1:] == [[], []]
