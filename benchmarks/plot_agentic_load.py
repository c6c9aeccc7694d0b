"""Goodput and later-turn time to first token against concurrent sessions, one line per policy,
from the JSON files `pensieve bench agentic --json` wrote (one or more runs each).

    python -m benchmarks.plot_agentic_load OUT.png RESULT.json ... [--title TEXT]

A file's policy is its label up to the first `_` (`gpu-only_nats` -> `gpu-only`); runs of one
policy from several files join one line, ordered by concurrency. Each point is marked with the
file's folder when the files come from more than one folder, so a line drawn from several calls
says so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ORDER = ("pensieve", "lru", "gpu-only", "stateless")


def points(paths: list[Path]) -> dict[str, list[tuple[int, float, float, str]]]:
    """policy -> [(concurrency, goodput turns/s, later-turn TTFT p50 s, folder)], by concurrency."""
    found: dict[str, list[tuple[int, float, float, str]]] = {}
    for path in paths:
        result: dict[str, Any] = json.loads(path.read_text())
        policy = result["label"].split("_")[0]
        for run in result["runs"]:
            later = run["ttft_later_s"]
            found.setdefault(policy, []).append(
                (
                    run["concurrency"],
                    run["goodput"]["turns_per_s"],
                    float("nan") if later is None else later["p50"],
                    path.parent.name,
                )
            )
    return {p: sorted(found[p]) for p in sorted(found, key=_rank)}


def _rank(policy: str) -> tuple[int, str]:
    return (ORDER.index(policy) if policy in ORDER else len(ORDER), policy)


def plot(out: Path, lines: dict[str, list[tuple[int, float, float, str]]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    figure, (good, ttft) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    folders = sorted({folder for line in lines.values() for *_, folder in line})
    markers = dict(zip(folders, "osD^vP*X", strict=False))
    for index, (policy, line) in enumerate(lines.items()):
        colour = f"C{index}"
        x = [c for c, *_ in line]
        good.plot(x, [g for _, g, _, _ in line], "-", color=colour, label=policy)
        ttft.plot(x, [t for _, _, t, _ in line], "-", color=colour, label=policy)
        for c, g, t, folder in line:
            marker = markers.get(folder, "o") if len(folders) > 1 else "o"
            good.plot([c], [g], marker, color=colour)
            ttft.plot([c], [t], marker, color=colour)
    good.set_title("goodput: turns a second within the objective", fontsize=10)
    ttft.set_title("time to first token of later turns, p50 (s, log)", fontsize=10)
    ttft.set_yscale("log")
    for axis in (good, ttft):
        axis.set_xlabel("concurrent sessions")
        axis.grid(alpha=0.3)
    good.legend(loc="upper left", fontsize=9)
    if len(folders) > 1:
        text = ", ".join(f"{markers[f]} {f}" for f in folders)
        figure.text(0.5, -0.02, f"points by call: {text}", ha="center", fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    plot(args.out, points(args.results), args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
