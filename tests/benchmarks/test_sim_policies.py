"""The policy simulator's steeper cost: attention's growth with context scaled in both the step
times it charges and the table the eviction ranks by."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sim_policies import steeper
from pensieve.actors.scheduler.kv.cost_model import CostModel

REPO = Path(__file__).resolve().parents[2]
H200_TABLE = REPO / "benchmarks/results/h200/cost_llama2-13b-gqa10.json"


def test_a_steeper_profile_multiplies_attentions_growth_only() -> None:
    measured = CostModel.from_json(H200_TABLE)
    assert steeper(measured, 1.0) is measured
    steep = steeper(measured, 8.0)
    floor = measured.attention_s[0]
    assert steep.attention_s[0] == floor and steep.non_attention_s == measured.non_attention_s
    for length in (64, 512, 1000, 4096):
        grown = measured.attention_cost(length) - floor
        assert steep.attention_cost(length) - floor == pytest.approx(8.0 * grown)
    ratio = measured.cost(4096) / measured.cost(32)
    assert 1.1 < ratio < 1.3  # the measured profile is nearly flat
    assert steep.cost(4096) / steep.cost(32) == pytest.approx(2.55, abs=0.01)


def test_a_slow_step_is_recorded_with_what_it_did() -> None:
    """The open loop keeps, for every step over SLOW_STEP_S, when it ran and its breakdown; here
    the simulator's device takes 0.7 s a step, so every step is slow."""
    from benchmarks.bench_workload import (
        SLOW_STEP_S,
        ConvSpec,
        History,
        OpenLoop,
        Turn,
        describe_slow_step,
        open_loop,
    )
    from benchmarks.sim_policies import SimClock, SimRunner, StepModel
    from pensieve.actors.config import CacheConfig, Policy, SchedulerConfig
    from pensieve.actors.scheduler.engine import Engine

    clock = SimClock()
    runner = SimRunner(clock, StepModel(fixed_ms=700.0))
    cost = CostModel.from_json(H200_TABLE)
    cache = CacheConfig(32, 64, 64, Policy.PENSIEVE)
    scheduling = SchedulerConfig(2048, 8, 4096, 8)
    engine = Engine(runner, cache, scheduling, cost.cost, frozenset(), clock=clock)  # type: ignore[arg-type]
    turn = Turn(tuple(range(1, 70)), (7,) * 3)
    specs = [ConvSpec(f"c{i}", (turn, turn)) for i in range(3)]
    options = OpenLoop(conv_rate=2.0, think_s=0.5, duration_s=4.0, drain_s=60.0)
    result = open_loop(engine, specs, options, History.GENERATED, sleep=clock.sleep)
    slow = result.extra["slow"]
    assert result.extra["compiles"] == []  # no Triton kernel here
    assert len(slow) == result.extra["slow_steps"] > 0
    assert all(s["ms"] >= SLOW_STEP_S * 1e3 and s["at_s"] >= 0 for s in slow)
    assert [s["at_s"] for s in slow] == sorted(s["at_s"] for s in slow)
    assert any(s["prefill_tokens"] >= 69 for s in slow)  # a first turn's prompt in one step
    assert any(s["kind"] == "decode" and s["decodes"] >= 1 for s in slow)
    assert all(s["wait_ms"] + s["launch_ms"] > 0 for s in slow)
    line = describe_slow_step(slow[0])
    assert line.startswith(f"{slow[0]['ms']:.0f} ms (") and "wait" in line
