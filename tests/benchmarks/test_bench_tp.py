"""The tensor-parallel benchmarks end to end at toy sizes on the CPU (`--smoke`: gloo ranks,
tiny-llama): each configuration runs and lands in the table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(module: str, out: Path, *args: str) -> str:
    command = [sys.executable, "-m", module, "--smoke", "--json", str(out), *args]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_the_decode_step_is_timed_on_one_rank_and_on_two(tmp_path: Path) -> None:
    stdout = _run("benchmarks.bench_tp", tmp_path / "tp.json")
    timings = json.loads((tmp_path / "tp.json").read_text())["timings"]
    assert [t["ranks"] for t in timings] == [1, 2]
    assert all(t["eager_s"] > 0 and t["error"] is None for t in timings)
    assert "x first" in stdout.splitlines()[-3]


def test_the_closed_loop_runs_per_rank_count_and_policy(tmp_path: Path) -> None:
    _run(
        "benchmarks.bench_tp_replay",
        tmp_path / "loop.json",
        "--ranks",
        "2",
        "--policies",
        "pensieve",
        "stateless",
        "--profile",
        "5,5",
        "--concurrency",
        "5",
    )
    results = json.loads((tmp_path / "loop.json").read_text())["results"]
    assert [(r["concurrency"], r["ranks"], r["policy"]) for r in results] == [
        (5, 2, "pensieve"),
        (5, 2, "stateless"),
    ]
    assert all(r["window"]["tok_per_s"] > 0 for r in results)
    for result in results:  # each rank profiled steps 5-9: its host's launches, its sums
        profile = result["profile"]
        assert profile["steps"] == [5, 9] and [r["rank"] for r in profile["ranks"]] == [0, 1]
        for rank in profile["ranks"]:
            assert rank["launch_ms"] > 0 and rank["busy_ms"] > 0
            assert rank["kinds_ms"]["all-reduce"] > 0
        reduces = profile["all_reduce"]
        assert reduces["calls"] >= 5 * 2 * 2  # two sums a layer, two layers, five steps
        assert all(w >= 0 for w in reduces["wait_s"])  # the transfer is the shortest call


def test_the_policy_sweep_steps_executor_ranks(tmp_path: Path) -> None:
    """`bench_gpu --sections policies --tensor-parallel 2`: every policy's open loop runs on the
    same two ranks, each point's engine counting its own swaps and keeping its own tiers (the
    CPU tier for `pensieve` alone)."""
    out = tmp_path / "policies.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_gpu",
        "--smoke",
        "--json",
        str(out),
        "--sections",
        "policies",
        "--tensor-parallel",
        "2",
        "--cost",
        "analytic",
        "--policies",
        "pensieve,gpu-only",
        "--rates",
        "pensieve=8,gpu-only=8",
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 executor ranks started" in proc.stdout
    runs = json.loads(out.read_text())["sections"]["policies"]["runs"]
    pensieve, gpu_only = runs["pensieve"][0], runs["gpu-only"][0]
    assert pensieve["drained"] and gpu_only["drained"]
    assert pensieve["finished"] > 0 and gpu_only["finished"] > 0
    assert pensieve["sources"]["cpu"] > 0 and pensieve["swapped_out_gb"] > 0
    # gpu-only ran after pensieve on the same ranks: none of pensieve's swaps are its own
    assert gpu_only["sources"]["cpu"] == 0 and gpu_only["swapped_out_gb"] == 0
