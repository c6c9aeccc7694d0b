"""The policy sweep's rate search and the merging of result files from separate calls."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_policies import alternation, combine, main, next_rate, sweep
from pensieve.actors.config import Policy


def test_next_rate_steps_until_a_pass_sits_under_a_fail() -> None:
    assert next_rate([10.0], [], 1.2) == 12.0
    assert next_rate([], [10.0], 1.2) == pytest.approx(8.33)
    assert next_rate([10.0], [12.0], 1.2) == pytest.approx(10.95)
    assert next_rate([10.0, 10.95], [12.0], 1.2) is None
    assert next_rate([10.0], [10.95, 12.0], 1.2) is None
    assert next_rate([8.0, 10.0], [14.0], 1.2) == pytest.approx(11.83)  # from the highest pass


@pytest.mark.parametrize(
    ("capacity", "want"), [(11.3, [10.0, 10.95, 12.0]), (7.0, [6.94, 8.33, 10.0])]
)
def test_sweep_brackets_the_capacity(capacity: float, want: list[float]) -> None:
    def run(rate: float) -> dict[str, Any]:
        return {"rate": rate, "passed": rate <= capacity}

    results = sweep(run, 10.0, 1.2, max_points=3, has_time=lambda: True)
    assert [r["rate"] for r in results] == pytest.approx(want)
    passed = [r["rate"] for r in results if r["passed"]]
    failed = [r["rate"] for r in results if not r["passed"]]
    assert max(passed) <= capacity < min(failed)


def test_sweep_stops_when_time_runs_out() -> None:
    calls = []

    def run(rate: float) -> dict[str, Any]:
        calls.append(rate)
        return {"rate": rate, "passed": True}

    sweep(run, 5.0, 1.2, max_points=5, has_time=lambda: len(calls) < 2)
    assert calls == [5.0, 6.0]


def _run(policy: str, rate: float, req_per_s: float, p90: float) -> dict[str, Any]:
    return {
        "policy": policy,
        "rate": rate,
        "req_per_s": req_per_s,
        "tok_per_s": 100 * req_per_s,
        "norm_latency_p50": p90 / 2,
        "norm_latency_p90": p90,
        "ttft_p50": 0.1,
        "ttft_p90": 0.2,
        "sources": {"gpu": 1, "cpu": 2, "recomputed": 3, "new": 4},
        "passed": p90 <= 0.1,
    }


def _report(path: Path, device: str, runs: dict[str, list[dict]], **settings: Any) -> Path:
    report = {
        "meta": {
            "device": device,
            "model": "m",
            "dtype": "bf16",
            "torch": "t",
            "transformers": "x",
        },
        "settings": {"latency_bound": 0.1, "think_s": 3.0, "policies": list(runs), **settings},
        "sections": {"policies": {"status": "ok", "runs": runs, "rows": []}},
    }
    path.write_text(json.dumps(report).replace("Infinity", '"inf"'))
    return path


def test_fixed_rates_alternate_between_the_policies_forwards_then_backwards() -> None:
    lru, pensieve = Policy.LRU, Policy.PENSIEVE
    order = alternation([lru, pensieve], {"lru": (16.3, 16.5), "pensieve": (16.3, 16.5, 16.7)})
    assert order == [(lru, 16.3), (pensieve, 16.3), (pensieve, 16.5), (lru, 16.5), (pensieve, 16.7)]
    gpu_only = Policy.GPU_ONLY
    rates = {"pensieve": (1.0, 2.0), "lru": (1.0, 2.0), "gpu-only": (1.0,)}
    three = alternation([pensieve, lru, gpu_only], rates)
    assert three == [(pensieve, 1), (lru, 1), (gpu_only, 1), (lru, 2), (pensieve, 2)]


def test_combine_merges_calls_into_one_comparison(tmp_path: Path, capsys) -> None:
    ours = [_run("pensieve", 14, 45.0, 0.08), _run("pensieve", 16.8, 30.0, math.inf)]
    theirs = [_run("stateless", 8.5, 25.0, 0.09), _run("stateless", 10.2, 20.0, 0.3)]
    a = _report(tmp_path / "a.json", "H200", {"pensieve": ours})
    b = _report(tmp_path / "b.json", "H200", {"stateless": theirs})
    report = combine([a, b])
    rows = {r["name"]: r for r in report["sections"]["policies"]["rows"]}
    ratio = rows["pensieve / stateless, req/s at bound"]
    assert ratio["value"] == 45.0 and ratio["ref"] == 25.0 and ratio["ok"] is True
    assert rows["pensieve / stateless, highest rate"]["ratio"] == pytest.approx(14 / 8.5)
    assert rows["pensieve / stateless, highest rate"]["ok"] is True  # 1.65 >= 1.6
    assert "pensieve / lru, req/s at bound" not in rows  # lru was not run
    merged = tmp_path / "merged.json"
    assert main(["combine", str(a), str(b), "--json", str(merged)]) == 0
    assert "pensieve / stateless, req/s at bound" in capsys.readouterr().out
    text = merged.read_text()
    assert "Infinity" not in text and json.loads(text)["sections"]["policies"]["runs"]["pensieve"]


def test_combine_keeps_repeats_and_a_rate_counts_only_if_it_always_passed(tmp_path: Path) -> None:
    first = [_run("pensieve", 11, 35.0, 0.09), _run("pensieve", 12, 40.0, 0.06)]
    again = [_run("pensieve", 12, 31.0, math.inf)]  # the same rate over the bound on a repeat
    theirs = [_run("stateless", 9, 28.0, 0.08), _run("stateless", 9, 27.0, 0.09)]
    a = _report(tmp_path / "a.json", "H200", {"pensieve": first}, max_points=3)
    b = _report(tmp_path / "b.json", "H200", {"pensieve": again, "stateless": theirs}, max_points=1)
    report = combine([a, b])
    runs = report["sections"]["policies"]["runs"]
    assert [r["rate"] for r in runs["pensieve"]] == [11, 12, 12]
    rows = {r["name"]: r for r in report["sections"]["policies"]["rows"]}
    assert rows["policy pensieve"]["value"] == 35.0  # 12 failed once: 11 is the best that held
    assert rows["policy stateless"]["value"] == 27.0  # of two passes at one rate, the lower


def test_combine_judges_the_points_again_at_another_bound(tmp_path: Path) -> None:
    ours = [_run("pensieve", 12, 40.0, 0.058), _run("pensieve", 13, 43.0, 0.09)]
    theirs = [_run("stateless", 8, 25.0, 0.059), _run("stateless", 9, 28.0, 0.076)]
    a = _report(tmp_path / "a.json", "H200", {"pensieve": ours, "stateless": theirs})
    at_run_bound = {r["name"]: r for r in combine([a])["sections"]["policies"]["rows"]}
    assert at_run_bound["policy pensieve"]["value"] == 43.0
    assert at_run_bound["policy stateless"]["value"] == 28.0
    report = combine([a], bound=0.06)
    tighter = {r["name"]: r for r in report["sections"]["policies"]["rows"]}
    assert report["sections"]["policies"]["latency_bound_s_per_token"] == 0.06
    assert tighter["policy pensieve"]["value"] == 40.0  # 13 is over 0.06
    assert tighter["policy stateless"]["value"] == 25.0
    assert tighter["pensieve / stateless, req/s at bound"]["ratio"] == pytest.approx(1.6)
    assert combine([a], bound=0.05)["sections"]["policies"]["rows"][0]["ok"] is False


def test_combine_refuses_other_devices_or_settings(tmp_path: Path, capsys) -> None:
    a = _report(tmp_path / "a.json", "H200", {"pensieve": [_run("pensieve", 14, 45.0, 0.08)]})
    b = _report(tmp_path / "b.json", "H100", {"stateless": [_run("stateless", 8, 25.0, 0.09)]})
    c = _report(tmp_path / "c.json", "H200", {"lru": [_run("lru", 8, 25.0, 0.09)]}, think_s=1.0)
    with pytest.raises(ValueError, match="H100"):
        combine([a, b])
    with pytest.raises(ValueError, match="think_s"):
        combine([a, c])
    assert main(["combine", str(a), str(tmp_path / "missing.json")]) == 2
    assert "error:" in capsys.readouterr().err
