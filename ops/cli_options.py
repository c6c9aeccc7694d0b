"""The options `pensieve serve`, `pensieve replay` and `pensieve actor` (each actor those it uses:
ops/cli_actor.py) share: the server's (NATS, HTTP, data, expiry), NATS credentials, the log level,
and how they become `ServeOptions`; the engine's are in cli_engine.py."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pensieve.actors.config import DEFAULTS, ExpiryConfig, StepChannel
from pensieve.actors.ingress.placement import PlacementConfig
from pensieve.actors.ingress.placement import Policy as PlacementPolicy

LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help ('none' where it has none), unless the help
    says it, or the option is a flag (off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        hidden = isinstance(default, bool) or default == argparse.SUPPRESS  # a flag: off
        if hidden or "default" in text or not action.option_strings:
            return text
        return text + f" (default: {'none' if default is None else default})"


class VllmHint(argparse.Action):
    """An option of `vllm serve` that Pensieve spells otherwise: refused with a line that names
    Pensieve's (hidden from --help)."""

    def __init__(self, option_strings: list[str], dest: str, hint: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)
        self.hint = hint

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error(f"{self.option_strings[0]} is vLLM's: {self.hint}")


def model_of(args: argparse.Namespace) -> str:
    """The model `--model` or the first word names (`pensieve serve MODEL`)."""
    word, flag = getattr(args, "model_word", None), args.model
    if word is not None and flag is not None and word != flag:
        raise ValueError(f"two models: {word!r} and --model {flag!r}; give one")
    if word is None and flag is None:
        raise ValueError("which model? pensieve serve MODEL (or --model MODEL)")
    return str(word or flag)


def nats_auth_args(p: argparse.ArgumentParser, embedded: bool, engine: bool = True) -> None:
    """NATS credentials; with `engine`, also the scheduler's watch on closed connections."""
    from pensieve.ops.nats_auth import add_connect_args, add_embedded_args, add_events_args

    add_connect_args(p)
    if engine:
        add_events_args(p)
    if embedded:
        add_embedded_args(p)


def server_args(p: argparse.ArgumentParser, embedded: bool = True) -> None:
    """The server's options; `embedded`: it may start a nats-server of its own (`serve`; an
    actor meets the others on one at --nats-url)."""
    server = p.add_argument_group("server")
    if embedded:
        server.add_argument(
            "--nats-port",
            type=int,
            metavar="PORT",
            default=DEFAULTS.nats_port,
            help="port of the nats-server started here, on 127.0.0.1",
        )
        server.add_argument(
            "--nats-url",
            metavar="URL",
            help="use the NATS server at this URL instead of starting one",
        )
    else:
        server.add_argument(
            "--nats-url",
            metavar="URL",
            required=True,
            help="the NATS server where the engine's actors meet (required)",
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
    engines = p.add_argument_group("many engines (docs/many-engines.md)")
    engines.add_argument(
        "--turn-log",
        choices=["lmdb", "jetstream"],
        default="lmdb",
        help="where committed turns go: 'lmdb' the local store alone (one engine); 'jetstream' "
        "also a replicated log on NATS JetStream, before each reply, so that another engine "
        "adopts the conversations of one that dies or drains (with leases)",
    )
    engines.add_argument(
        "--turn-log-replicas",
        type=int,
        default=0,
        metavar="N",
        help="copies of the turn log (0: as many servers as the cluster has, at most 3)",
    )
    engines.add_argument(
        "--lease-ttl",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds an engine's lease lives unrenewed: its conversations move this long after "
        "it dies, at most",
    )
    engines.add_argument(
        "--placement",
        choices=[policy.value for policy in PlacementPolicy],
        default=PlacementPolicy.PREFIX.value,
        help="where the ingress sends a turn that names no conversation, among the engines on "
        "this NATS: 'prefix' the engine holding most of a resent history's prompt, weighed "
        "against load, and a new conversation the least loaded one; 'load' the least loaded "
        "one; 'random' any live engine",
    )
    engines.add_argument(
        "--prefix-weight",
        type=float,
        default=PlacementConfig.prefix_weight,
        metavar="W",
        help="with --placement prefix: an engine costs W x the prompt blocks it would prefill, "
        "plus the blocks of the turns it has in hand; the cheapest is chosen",
    )
    http = p.add_argument_group("HTTP (OpenAI-compatible API and Prometheus metrics)")
    http.add_argument(
        "--http-port",
        "--port",  # vLLM's name: its OpenAI API's port
        type=int,
        metavar="PORT",
        help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/models), /health and "
        "/metrics on this port (default: none; 8000 for `pensieve actor http`)",
    )
    http.add_argument(
        "--http-host",
        "--host",  # vLLM's name
        default="127.0.0.1",
        metavar="HOST",
        help="address the HTTP port listens on (0.0.0.0: every interface)",
    )
    http.add_argument(
        "--http-read-timeout",
        type=float,
        default=DEFAULTS.http_read_timeout_s,
        metavar="S",
        help="seconds a request's headers, and then its body, get to arrive; a connection idle "
        "this long is closed",
    )
    http.add_argument(
        "--http-max-connections",
        type=int,
        default=DEFAULTS.http_max_connections,
        metavar="N",
        help="HTTP connections open at once; one more is answered 503 and closed",
    )
    http.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in the HTTP API (default: the --model argument)",
    )
    http.add_argument(
        "--api-key",
        action=VllmHint,
        hint="HTTP API keys are per tenant: `pensieve tenant add NAME --out FILE` makes one "
        "(FILE's http.api_key)",
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


def log_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="info: each start-up phase and one line per finished turn",
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def positive(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def serve_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
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
            read_timeout_s=args.http_read_timeout,
            max_connections=args.http_max_connections,
        )
    )
    return ServeOptions(
        data_dir=data_dir,
        nats_auth=nats_auth_from_args(args),
        events_auth=events_auth_from_args(args),
        auth_data_dir=auth_data_dir(args, data_dir),
        nats_url=args.nats_url,
        nats_port=getattr(args, "nats_port", DEFAULTS.nats_port),  # an actor starts none
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
        turn_log=args.turn_log == "jetstream",
        turn_log_replicas=args.turn_log_replicas,
        lease_ttl_s=args.lease_ttl,
        placement=PlacementConfig(PlacementPolicy(args.placement), args.prefix_weight),
    )
