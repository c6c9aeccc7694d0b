"""Every pair of pensieve and lru runs at the same rate, within one call, at the full tiers.

Reads the recorded policy calls (ops/results/policies_h200_*.json) and pairs the i-th pensieve
run at a rate with the i-th lru run at that rate in the same file. Prints, for sessions 8 on (the
builds with today's scheduler), how the pairs split by pass / fail and, where both passed, which
recomputed less and which served more.

    python3 ops/results/diag_s16/pairs.py
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1]
FULL_TIERS = {"gpu_tokens": 196608, "cpu_tokens": 262144, "max_num_seqs": 256}


def runs(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if {"policy", "rate", "req_per_s", "passed"} <= node.keys():
            yield node
        for value in node.values():
            yield from runs(value)
    elif isinstance(node, list):
        for value in node:
            yield from runs(value)


def session(path: Path) -> int:
    match = re.search(r"_s(\d+)", path.stem)
    return int(match.group(1)) if match else 0


def main() -> None:
    both, split, neither = [], [], []
    for path in sorted(RESULTS.glob("policies_h200_s*.json"), key=lambda p: (session(p), p.stem)):
        if session(path) < 8:
            continue
        data = json.loads(path.read_text())
        settings = data.get("settings", {})
        if any(settings.get(key) != value for key, value in FULL_TIERS.items()):
            continue
        by_rate: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
        for run in runs(data):
            by_rate[run["policy"], run["rate"]].append(run)
        for (policy, rate), ours in by_rate.items():
            if policy != "pensieve":
                continue
            for p, lru in zip(ours, by_rate.get(("lru", rate), [])):
                row = (path.stem, rate, p, lru)
                if p["passed"] and lru["passed"]:
                    both.append(row)
                elif p["passed"] or lru["passed"]:
                    split.append(row)
                else:
                    neither.append(row)
    print(f"{len(both)} pairs where both passed, {len(split)} where one did, {len(neither)} neither")
    for name, rate, p, lru in split:
        winner = "pensieve" if p["passed"] else "lru"
        print(f"  one passed: {name} @ {rate}: {winner} (p90 pensieve "
              f"{float(p['norm_latency_p90']):.3f}, lru {float(lru['norm_latency_p90']):.3f})")
    if not both:
        return
    recomputed = [(p["sources"]["recomputed"], lru["sources"]["recomputed"]) for *_, p, lru in both]
    served = [(p["req_per_s"], lru["req_per_s"]) for *_, p, lru in both]
    n = len(both)
    print(f"both passed: pensieve recomputed less in {sum(a < b for a, b in recomputed)}, lru in "
          f"{sum(b < a for a, b in recomputed)}; mean {sum(a for a, _ in recomputed) / n / 1e3:.1f}k "
          f"against {sum(b for _, b in recomputed) / n / 1e3:.1f}k tokens")
    print(f"both passed: pensieve served more in {sum(a > b for a, b in served)}, lru in "
          f"{sum(b > a for a, b in served)}; mean {sum(a for a, _ in served) / n:.2f} against "
          f"{sum(b for _, b in served) / n:.2f} req/s")


if __name__ == "__main__":
    main()
