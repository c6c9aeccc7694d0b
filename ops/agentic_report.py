"""The table and plot of `pensieve bench agentic` runs (`ops/agentic_summary.py`'s summaries),
and the sweeps `--json` wrote, read back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

AGENTIC = "agentic"


COLUMNS = (
    ("turns/s", lambda r: f"{r['turns_per_s']:.2f}"),
    ("out tok/s", lambda r: f"{r['output_tok_per_s']:.0f}"),
    ("in tok/s", lambda r: f"{r['input_tok_per_s']:.0f}"),
    ("ttft1 p50", lambda r: _at(r["ttft_first_s"], "p50", 1)),
    ("ttft1 p90", lambda r: _at(r["ttft_first_s"], "p90", 1)),
    ("ttft p50", lambda r: _at(r["ttft_later_s"], "p50", 1)),
    ("ttft p90", lambda r: _at(r["ttft_later_s"], "p90", 1)),
    ("ttft p99", lambda r: _at(r["ttft_later_s"], "p99", 1)),
    ("tpot p50 ms", lambda r: _at(r["tpot_s"], "p50", 1000)),
    ("tpot p90 ms", lambda r: _at(r["tpot_s"], "p90", 1000)),
    ("itl p90 ms", lambda r: _at(r["itl_s"], "p90", 1000)),
    ("e2e p50", lambda r: _at(r["latency_s"], "p50", 1)),
    ("gpu", lambda r: f"{r['prompt_share']['gpu']:.0%}"),
    ("cpu", lambda r: f"{r['prompt_share']['cpu']:.0%}"),
    ("recomp", lambda r: f"{r['prompt_share']['recomputed']:.0%}"),
    ("new", lambda r: f"{r['prompt_share']['new']:.0%}"),
    ("shared", lambda r: _share(r["prompt_sources"]["shared"], r["prompt_tokens"])),
    ("reuse", lambda r: _share(r["reuse"]["share_of_allowed"], 1)),
    ("good turns/s", lambda r: f"{r['goodput']['turns_per_s']:.2f}"),
    ("good sess/s", lambda r: f"{r['goodput']['sessions_per_s']:.3f}"),
    ("errors", lambda r: ",".join(f"{k}:{v}" for k, v in sorted(r["errors"].items())) or "-"),
)


def _at(found: dict[str, float] | None, key: str, scale: float) -> str:
    return "-" if found is None else f"{found[key] * scale:.3f}"


def _share(part: float | None, whole: float) -> str:
    return "-" if part is None or not whole else f"{part / whole:.0%}"


def _mode(run: dict[str, Any]) -> str:
    return f"{run['session_rate']:g}/s" if "session_rate" in run else f"c={run['concurrency']}"


def table(label: str, runs: Sequence[dict[str, Any]]) -> str:
    """One row per run: times in seconds unless marked ms; prompt tokens by source as shares
    (`shared`: of the GPU's and CPU's, found in another conversation's chunks; `reuse`: of what
    later turns may take from the cache, the share that came from it). Under it, a line per
    run with the engine's prefix-cache counters and one with the long prompt's figures."""
    rows = [("run", *(name for name, _ in COLUMNS))]
    rows += [(f"{label} {_mode(run)}", *(cell(run) for _, cell in COLUMNS)) for run in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    for run in runs:
        name = f"{label} {_mode(run)}"
        if (cache := run.get("server", {}).get("prefix_cache")) is not None:
            lines.append(f"{name} server prefix cache: {_prefix_cache(cache)}")
        if (saves := run.get("server", {}).get("disk_saves")) is not None:
            lines.append(
                f"{name} server disk saves: {saves['ahead']} ahead of eviction, "
                f"{saves['on_eviction']} on it, {saves.get('not_worth_reading', 0)} not saved "
                "(cheaper to recompute than to read)"
            )
        if (long := run.get("long_prompt")) is not None:
            lines.append(f"{name} long prompt: {_long_prompt(long)}")
        for step in run.get("server", {}).get("slow_steps", [])[:SLOW_STEPS]:
            lines.append(f"{name} slow step: {_slow_step(step)}")
        if stalls := run.get("server", {}).get("loop_stalls"):
            lines.append(
                f"{name} event loop's longest stalls: "
                + ", ".join(f"{s['lag_s'] * 1000:.0f} ms at {s['run_s']:.1f} s" for s in stalls[:4])
            )
    return "\n".join(lines)


SLOW_STEPS = 3  # the longest step intervals shown under a run


def _slow_step(step: dict[str, Any]) -> str:
    """One of the engine's longest step intervals (`actors/scheduler/step_log.py`): its host
    work before the step, then the step's phases and what it did, in ms."""
    between, phases = step["between"], step["phases"]
    text = (
        f"{step['interval_s'] * 1000:.0f} ms at {step.get('run_s', step['at_s']):.1f} s: before it "
        f"{between['commands']} calls {between['commands_s'] * 1000:.1f} ms"
        + (
            f" ({between['slowest_command']} {between['slowest_command_s'] * 1000:.1f})"
            if between["commands"]
            else ""
        )
        + f", snapshot {between['snapshot_s'] * 1000:.1f}; step {step['step_s'] * 1000:.1f}"
    )
    if phases is None:
        return text
    return text + (
        f" = schedule {phases['schedule_s'] * 1000:.1f} launch {phases['launch_s'] * 1000:.1f} "
        f"wait {phases['wait_s'] * 1000:.1f} update {phases['update_s'] * 1000:.1f}; "
        f"{phases['kind']}: {phases['decodes']} decodes over {phases['decode_positions']} "
        f"positions, {phases['prefill_tokens']} prefill tokens, {phases['swap_in']} blocks in, "
        f"{phases['swap_out']} out"
    )


def _prefix_cache(cache: dict[str, Any]) -> str:
    return (
        f"{cache['hits']} of {cache['queries']} prompt tokens hit, {cache['shared_hits']} "
        f"shared; {cache['shared_chunks']} shared chunks, "
        f"{cache['bytes_saved'] / 2**20:.1f} MiB saved" + ("" if cache["sharing"] else " (off)")
    )


def _long_prompt(long: dict[str, Any]) -> str:
    ttft = "-" if long["ttft_s"] is None else f"{long['ttft_s']:.3f} s"
    during, rest = long["itl_during_s"], long["itl_rest_s"]
    return (
        f"{long['prompt_tokens']} tokens sent at {long['at_s']:.1f} s, ttft {ttft}; sessions' "
        f"itl p50/p99 while it waited {_at(during, 'p50', 1000)}/{_at(during, 'p99', 1000)} "
        f"ms, otherwise {_at(rest, 'p50', 1000)}/{_at(rest, 'p99', 1000)} ms"
        + _per_token(long)
        + ("" if long["error"] is None else f" (error {long['error']})")
        + _longest(long.get("longest_during", []))
    )


def _per_token(long: dict[str, Any]) -> str:
    during, rest = long.get("itl_token_during_s"), long.get("itl_token_rest_s")
    if during is None and rest is None:
        return ""
    return (
        f" (between tokens {_at(during, 'p50', 1000)}/{_at(during, 'p99', 1000)} and "
        f"{_at(rest, 'p50', 1000)}/{_at(rest, 'p99', 1000)} ms)"
    )


def _longest(gaps: list[dict[str, Any]]) -> str:
    """The longest gap while it waited, and how many of the longest ended within 0.1 s of it."""
    if not gaps:
        return ""
    top = gaps[0]
    together = sum(abs(g["end_s"] - top["end_s"]) <= 0.1 for g in gaps)
    return (
        f"; longest gap {top['gap_s'] * 1000:.0f} ms ended at {top['end_s']:.1f} s, with "
        f"{together - 1} of the next {len(gaps) - 1} longest within 0.1 s of it"
    )


PANELS = (
    ("p90 time to first token (s): later turns, - - turn 1", "ttft_later_s", "ttft_first_s", 1),
    ("p90 time per output token (ms), - - inter-token", "tpot_s", "itl_s", 1000),
)


def plot(path: Path, sweeps: dict[str, list[dict[str, Any]]]) -> None:
    """Against turns served a second, one colour per labelled sweep: p90 time to first token
    (later turns; dashed, turn 1), p90 time per output token (dashed, inter-token latency),
    goodput, and the share of prompt tokens from the GPU (dashed: CPU, dotted: recomputed)."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 8), constrained_layout=True)
    for index, (label, runs) in enumerate(sweeps.items()):
        colour = f"C{index}"
        ordered = sorted(runs, key=lambda r: r["turns_per_s"])
        x = [r["turns_per_s"] for r in ordered]
        for axis, (_, solid, dashed, scale) in zip(axes[0], PANELS, strict=True):
            _line(axis, x, [_p90(r[solid], scale) for r in ordered], f"-{colour}", label)
            _line(axis, x, [_p90(r[dashed], scale) for r in ordered], f"--{colour}")
        _line(axes[1][0], x, [r["goodput"]["turns_per_s"] for r in ordered], f"-{colour}", label)
        for source, style in (("gpu", "-"), ("cpu", "--"), ("recomputed", ":")):
            _line(axes[1][1], x, [r["prompt_share"][source] for r in ordered], style + colour)
    titles = (
        *(title for title, *_ in PANELS),
        "goodput: turns a second within the objective",
        "share of prompt tokens: GPU, - - CPU, .. recomputed",
    )
    for axis, title in zip(axes.flat, titles, strict=True):
        axis.set_xlabel("turns served per second")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=max(len(labels), 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _line(
    axis: Any, x: list[float], ys: list[float | None], style: str, label: str | None = None
) -> None:
    """`style` is matplotlib's format string: a line style, then the colour."""
    points = [(a, b) for a, b in zip(x, ys, strict=True) if b is not None]
    if points:
        axis.plot(*zip(*points, strict=True), style, marker="o", label=label)


def _p90(found: dict[str, float] | None, scale: float) -> float | None:
    return None if found is None else found["p90"] * scale


def read_agentic(paths: Sequence[Path]) -> dict[str, list[dict[str, Any]]]:
    """The agentic sweeps that `--json` wrote, by label."""
    sweeps = {}
    for path in paths:
        found = json.loads(path.read_text())
        if found.get("workload") != AGENTIC:
            raise ValueError(f"{path} holds no agentic sweep")
        sweeps[found["label"]] = found["runs"]
    return sweeps
