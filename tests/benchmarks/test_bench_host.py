"""The host-time benchmark drives the real scheduler and cache manager into a loaded state."""

from __future__ import annotations

from benchmarks.bench_host import main, run


def test_a_short_run_loads_the_gpu_and_times_both_phases(capsys) -> None:
    result = run(steps=150, seed=1)
    assert result["running"] > 20  # many requests at once, as in the policy benchmark
    assert result["schedule_ms"] > 0 and result["update_ms"] > 0
    assert main(["--steps", "60"]) == 0
    assert "per step: schedule" in capsys.readouterr().out


def test_the_text_cost_of_streams_is_timed_both_ways(capsys) -> None:
    assert main(["--streams", "4", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer replica" in out and "whole-reply decode" in out
