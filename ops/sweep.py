"""`pensieve bench`: load a running server with real conversations and report what it served.

Closed loop (`--concurrency N`: N conversations at once), or a sweep of Poisson arrival rates
(`--rates 1,2,4`: new conversations a second, each next turn sent after a think time). A
progress bar while it runs; at the end, each run's figures as `vllm bench serve` prints them
(`ops/load_report.py`) and a table of all; each run's summary (`ops/load.py`) in `--json`
under `--label`; and `--plot FILE.png` draws normalized latency and time to first token against
the request rate (closed loop: against the concurrency), one line per labelled sweep (this one
and those of `--compare` files), so two servers or two policies are one picture.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pensieve.actors.wire.bus import ConnectOptions
from pensieve.ops.chat import add_connection_args, connect_client
from pensieve.ops.load import ChatClient, LoadOptions, NatsClient, Window, run_load, run_poisson
from pensieve.ops.load_report import Report, add_report_args, finite, format_result, report_of
from pensieve.ops.sharegpt import Conversation, human_turns, load_conversations

COLUMNS = (
    "run",
    "turns/s",
    "out tok/s",
    "ttft p50",
    "ttft p90",
    "norm p50",
    "norm p90",
    "gpu",
    "cpu",
    "disk",
    "recomp",
    "new",
    "errors",
)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "conversations",
        nargs="?",
        default="sharegpt",
        help="a conversations file (JSON Lines), 'sharegpt', or 'agentic' for generated agent "
        "sessions (see their options below)",
    )
    add_connection_args(parser)
    parser.add_argument(
        "--http",
        metavar="URL",
        help="drive the OpenAI API at URL (http://HOST:PORT/v1) instead of NATS, "
        "as the --tenant file's key, else $OPENAI_API_KEY",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="with --http: the model to ask for (default: the one listed)",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--num-conversations",
        "--sessions",
        type=int,
        default=32,
        metavar="N",
        help="conversations, or agentic sessions",
    )
    load.add_argument(
        "--max-turns", type=int, default=3, metavar="N", help="turns of each conversation at most"
    )
    load.add_argument(
        "--max-tokens", type=int, default=128, metavar="N", help="tokens per reply at most"
    )
    load.add_argument("--ignore-eos", action="store_true", help="every reply max-tokens long")
    load.add_argument(
        "--concurrency",
        default="8",
        metavar="N,N,...",
        help="closed loop: one run with N conversations at once for each N (without --rates)",
    )
    load.add_argument(
        "--rates",
        metavar="R,R,...",
        help="Poisson arrivals instead: one run at each rate of new conversations a second",
    )
    load.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        metavar="S",
        help="with --rates: mean seconds from a reply to the next turn",
    )
    load.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="with --rates: conversations arrive for S seconds at each rate "
        "(taken again from the first when all have come) and no turn is sent "
        "after; by default each conversation comes once",
    )
    load.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        metavar="S",
        help="with --duration: count only the turns sent after S seconds, once "
        "the server has filled up",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="of the arrivals, think times and agentic sessions"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--label", default="pensieve", help="this sweep's name in JSON and plots")
    out.add_argument("--json", type=Path, metavar="FILE", help="write the sweep's runs here")
    out.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw normalized latency and TTFT against the request rate",
    )
    out.add_argument(
        "--compare",
        type=Path,
        nargs="*",
        default=[],
        metavar="JSON",
        help="other sweeps (their --json) to draw beside this one",
    )
    out.add_argument(
        "--replot",
        action="store_true",
        help="load nothing: draw --plot from the --compare sweeps alone",
    )
    out.add_argument(
        "--bound",
        type=float,
        metavar="S",
        help="with --replot: print each --compare sweep's requests served a second where its p90 "
        "normalized latency reaches S seconds a token (interpolated between the rates around it)",
    )
    add_report_args(parser)


def parse_counts(text: str) -> list[int]:
    """`--concurrency`: positive integers separated by commas."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--concurrency must be integers separated by commas, got {text!r}"
        ) from None
    if not all(c >= 1 for c in counts):
        raise ValueError("--concurrency must be >= 1")
    return counts


def parse_rates(text: str | None) -> list[float]:
    if text is None:
        return []
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--rates must be numbers separated by commas, got {text!r}") from None
    if not rates or not all(r > 0 and math.isfinite(r) for r in rates):
        raise ValueError("--rates must be positive")
    return rates


@dataclasses.dataclass(frozen=True)
class Server:
    """Where the load goes: NATS at `url` as `connect` says, or the OpenAI API at `http`."""

    url: str
    connect: ConnectOptions | None = None
    http: str | None = None
    api_key: str = "EMPTY"
    model: str | None = None


async def connect(server: Server) -> tuple[ChatClient, Any]:
    """The load's client, and what closes it."""
    if server.http is not None:
        from pensieve.ops.openai_client import OpenAIChatClient, base_url

        client = OpenAIChatClient(base_url(server.http), server.api_key, server.model)
        await client.served_model()  # fails here if nothing answers
        return client, client.close
    bus = await connect_client(server.url, "pensieve-bench", server.connect)
    return NatsClient(bus), bus.close


async def sweep(
    server: Server,
    conversations: list[Conversation],
    options: LoadOptions,
    rates: Sequence[float],
    think_s: float,
    seed: int,
    window: Window | None = None,
    on_run: Callable[[list[dict[str, Any]]], None] | None = None,
    concurrencies: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """One run per rate (without rates, one closed-loop run per concurrency, by default
    `options.concurrency`), each with a progress bar; `on_run` gets the runs so far after each
    one (a sweep cut short keeps what it measured)."""
    client, close = await connect(server)
    total: int | None = None  # with a window: as many as arrive in it
    if window is None:
        total = sum(len(list(human_turns(c))[: options.max_turns]) for c in conversations)
    runs = []
    try:
        closed = [dataclasses.replace(options, concurrency=c) for c in concurrencies]
        chosen: list[tuple[float | None, LoadOptions]] = [(r, options) for r in rates]
        chosen = chosen or [(None, o) for o in closed or [options]]
        for rate, run in chosen:
            name = f"{rate:g}/s" if rate is not None else f"c={run.concurrency}"
            with tqdm(total=total, desc=name, unit="turn", leave=False) as bar:
                told = dataclasses.replace(run, on_turn=lambda: bar.update(1))
                if rate is None:
                    runs.append(await run_load(client, conversations, told))
                else:
                    runs.append(
                        await run_poisson(client, conversations, told, rate, think_s, seed, window)
                    )
            if on_run is not None:
                on_run(runs)
    finally:
        await close()
    return runs


def table(label: str, runs: Sequence[dict[str, Any]]) -> str:
    rows = [COLUMNS]
    for run in runs:
        mode = (
            f"{run['request_rate']:g}/s"
            if "request_rate" in run
            else f"c={run.get('concurrency', '?')}"
        )
        sources = run["prompt_sources"]
        errors = ",".join(f"{k}:{v}" for k, v in sorted(run["errors"].items())) or "-"
        rows.append(
            (
                f"{label} {mode}",
                f"{run['turns_per_s']:.2f}",
                f"{run['output_tok_per_s']:.1f}",
                _seconds(run["ttft_s_p50"], 3),
                _seconds(run["ttft_s_p90"], 3),
                _seconds(run["norm_latency_s_p50"], 4),
                _seconds(run["norm_latency_s_p90"], 4),
                str(sources["gpu"]),
                str(sources["cpu"]),
                str(sources["disk"]),
                str(sources["recomputed"]),
                str(sources["new"]),
                errors,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def _seconds(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _closed(runs: Sequence[dict[str, Any]]) -> bool:
    """Whether these are closed-loop runs (else rate runs)."""
    return all("request_rate" not in run for run in runs)


def check_plot(args: argparse.Namespace, closed: bool) -> None:
    """Before a run: that `--plot` can draw what it will measure (`closed`: closed-loop runs)
    beside the `--compare` sweeps, with matplotlib installed."""
    if args.plot is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: "
            "pip install matplotlib (or pip install 'pensieve-serve[bench]')"
        ) from None
    for path in args.compare:
        found = json.loads(path.read_text())
        if found.get("workload") is None and found["runs"] and _closed(found["runs"]) != closed:
            kinds = ("rate runs", "closed-loop runs")
            raise ValueError(
                f"--plot: {path} holds {kinds[not closed]}, this bench measures "
                f"{kinds[closed]}: the two have no common x axis (concurrency, request rate)"
            )


def plot(path: Path, sweeps: dict[str, list[dict[str, Any]]]) -> None:
    """Normalized latency (p90) and time to first token (p90), one line per labelled sweep:
    against the requests served a second for rate runs, against the concurrency for
    closed-loop runs."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4.4), constrained_layout=True)
    panels = (
        ("norm_latency_s_p90", "p90 normalized latency (s / token)"),
        ("ttft_s_p90", "p90 time to first token (s)"),
    )
    closed = _closed([run for runs in sweeps.values() for run in runs])
    x = "concurrency" if closed else "turns_per_s"
    for axis, (key, title) in zip(axes, panels, strict=True):
        for label, runs in sweeps.items():
            points = sorted((r[x], r[key]) for r in runs if r[key] is not None)
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=label)
        axis.set_xlabel("conversations at once" if closed else "requests served per second")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    # one legend under both panels, off the data
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=max(len(labels), 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


def results(label: str, runs: Sequence[dict[str, Any]], report: Report) -> str:
    """Each run's figures as `vllm bench serve` prints them."""
    return "\n".join(format_result(f"{label} {_mode(run)}", run, report) for run in runs)


def _mode(run: dict[str, Any]) -> str:
    if "request_rate" in run:
        return f"{run['request_rate']:g}/s"
    if "session_rate" in run:
        return f"{run['session_rate']:g} sessions/s"
    return f"c={run['concurrency']}"


def write_json(path: Path, found: dict[str, Any]) -> None:
    """`found` as JSON with null for what was not measured, never NaN."""
    path.write_text(json.dumps(finite(found), indent=1, allow_nan=False))


def read_sweeps(paths: Sequence[Path]) -> dict[str, list[dict[str, Any]]]:
    """The sweeps that `--json` wrote, by label."""
    sweeps = {}
    for path in paths:
        found = json.loads(path.read_text())
        sweeps[found["label"]] = found["runs"]
    return sweeps


def replot(args: argparse.Namespace) -> int:
    """`--replot`: the picture of sweeps measured before, and (`--bound`) what each served at
    a latency bound."""
    if (args.plot is None and args.bound is None) or not args.compare:
        raise ValueError(
            "--replot draws --plot FILE.png (or prints --bound) from the sweeps given to --compare"
        )
    if args.plot is not None:
        plot(args.plot, read_sweeps(args.compare))
    if args.bound is not None:
        for path in args.compare:
            found = json.loads(path.read_text())
            served = served_at_bound(found["runs"], args.bound)
            text = "never reached" if served is None else f"{served:.2f} requests/s"
            print(f"{found['label']} ({path}): {text} at p90 {args.bound:g} s/token")
    return 0


def served_at_bound(runs: Sequence[dict[str, Any]], bound: float) -> float | None:
    """Requests served a second where the p90 normalized latency first passes `bound`, linear
    between the two runs (by requests served) around it; None when no run passes it or the
    first already does."""
    points = sorted(
        (r["turns_per_s"], r["norm_latency_s_p90"])
        for r in runs
        if r.get("norm_latency_s_p90") is not None
    )
    for (served, latency), (next_served, next_latency) in itertools.pairwise(points):
        if latency <= bound < next_latency:
            share = (bound - latency) / (next_latency - latency)
            return served + share * (next_served - served)
    return None


def server_of(args: argparse.Namespace, url: str, connect: ConnectOptions | None) -> Server:
    """Where the bench's options send the load."""
    if args.http is None:
        return Server(url, connect)
    from pensieve.ops.openai_client import api_key

    return Server(url, None, args.http, api_key(args.tenant), args.model)


def bench(args: argparse.Namespace, url: str, connect: ConnectOptions | None) -> int:
    rates = parse_rates(args.rates)
    window = None
    if args.duration is not None:
        if not rates:
            raise ValueError("--duration times a rate run: give --rates too")
        window = Window(args.duration, args.warmup)
    elif args.warmup:
        raise ValueError("--warmup needs --duration")
    concurrencies = parse_counts(args.concurrency)
    report = report_of(args)
    check_plot(args, closed=not rates)
    conversations = load_conversations(args.conversations, args.num_conversations)
    options = LoadOptions(
        concurrencies[0],
        args.max_turns,
        args.max_tokens,
        args.ignore_eos,
        probe_every_s=0.0,
        report=report,
    )
    server = server_of(args, url, connect)

    def save(runs: list[dict[str, Any]]) -> None:
        if args.json is not None:
            write_json(args.json, {"label": args.label, "runs": runs})

    runs = asyncio.run(
        sweep(
            server,
            conversations,
            options,
            rates,
            args.think_time,
            args.seed,
            window,
            save,
            concurrencies,
        )
    )
    print(results(args.label, runs, report))
    print(table(args.label, runs))
    if args.plot is not None:
        plot(args.plot, {args.label: runs, **read_sweeps(args.compare)})
    return 0 if all(run["turns"] for run in runs) else 1
