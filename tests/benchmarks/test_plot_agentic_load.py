"""The goodput-against-load plot of agentic results (`benchmarks/plot_agentic_load.py`), drawn
from the result files of real GPU runs in the repository."""

from __future__ import annotations

from pathlib import Path

from benchmarks import plot_agentic_load

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "h200" / "agentic_32k"


def test_runs_of_one_policy_from_several_calls_make_one_line_by_concurrency(tmp_path) -> None:
    files = sorted((RESULTS / "sweep_a").glob("*.json")) + sorted(
        (RESULTS / "sessions_20_same_card").glob("*.json")
    )
    lines = plot_agentic_load.points(files)
    assert list(lines) == ["pensieve", "gpu-only", "stateless"]
    pensieve = lines["pensieve"]
    assert [c for c, *_ in pensieve] == [4, 8, 16, 20]
    assert {folder for *_, folder in pensieve} == {"sweep_a", "sessions_20_same_card"}
    goodput_at_20 = pensieve[-1][1]
    assert abs(goodput_at_20 - 2.92) < 0.01  # as docs/benchmarks/agentic.md reports it
    out = tmp_path / "load.png"
    assert plot_agentic_load.main([str(out), *map(str, files), "--title", "t"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
