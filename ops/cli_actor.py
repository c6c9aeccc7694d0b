"""`pensieve actor NAME`: one parser per actor, with the options of `pensieve serve` that the
actor uses. `pensieve actor NAME --help` lists those alone; another of serve's options is refused
with a line that names the actor and the actors that take it.

`TAKEN_BY` names the options some actors leave alone; every actor takes the others (where the
actors meet, the engine's store, the NATS credentials, logs and traces)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from pensieve.ops.cli_engine import engine_args
from pensieve.ops.cli_options import HelpFormatter, log_arg, nats_auth_args, server_args

# what each actor does, by the name `pensieve actor NAME` runs it under, as ops/deploy.py's
# ACTORS has them: named here so that the parser does not import the actors (and torch)
ACTORS = {
    "ingress": "serves the client API (pensieve.v1.*) and hands each request to the scheduler",
    "http": "serves the OpenAI-compatible HTTP API (--http-port, default 8000) in front of the "
    "ingress",
    "tokenizer": "renders chat templates and finds the replies' text: --tokenizers replicas",
    "scheduler": "admits and schedules the turns, steps the executor and commits the turns; "
    "runs --tokenizers tokenizer replicas (0: none) and the metrics port beside it",
    "recompute-planner": "says which positions of a returning conversation's history to recompute",
    "executor": "loads the model and its KV tiers and runs the step plans it is sent",
}
ACTOR_NAMES = tuple(ACTORS)

_ENGINE = ("executor", "scheduler")
_MODEL = ("executor", "scheduler", "tokenizer")
_TEMPLATE = ("scheduler", "tokenizer")
_SCHEDULER = ("scheduler",)
_EXECUTOR = ("executor",)
_HTTP = ("http",)
# the options (by dest) that only some actors use, and which
TAKEN_BY: dict[str, tuple[str, ...]] = {
    "model": (*_MODEL, "http"),  # http: the model's name in the API
    "tokenizer": _MODEL,  # the executor's grammars sample over its vocabulary
    "chat_template": _TEMPLATE,
    "tool_call_parser": _TEMPLATE,
    "device": _EXECUTOR,
    "dtype": _ENGINE,  # the scheduler's: in the chunk keys, and its step-time estimate
    "tensor_parallel": _ENGINE,
    "cpu_threads": _EXECUTOR,
    "seed": _ENGINE,
    "policy": _ENGINE,
    "block_size": (*_ENGINE, "recompute-planner"),
    "gpu_cache_tokens": _EXECUTOR,
    "gpu_cache_gb": _EXECUTOR,
    "cpu_cache_tokens": _EXECUTOR,
    "cpu_cache_gb": _EXECUTOR,
    # the disk tier's files are the executor's; the scheduler learns of it from the executor
    "disk_cache_dir": _EXECUTOR,
    "disk_cache_gb": _EXECUTOR,
    "disk_read_gbps": _EXECUTOR,
    "swap_out_threshold": _SCHEDULER,
    "prefix_sharing": _SCHEDULER,
    "public_prompts": _SCHEDULER,
    "profile": _SCHEDULER,
    "max_batch_tokens": _SCHEDULER,
    "max_model_len": _SCHEDULER,
    "max_num_seqs": _SCHEDULER,
    "admission_reserve": _SCHEDULER,
    "admit_batch": _SCHEDULER,
    "max_step_slowdown": _SCHEDULER,
    "min_prefill_tokens": _SCHEDULER,
    "overlap": _SCHEDULER,
    "max_waiting": _SCHEDULER,
    "tokenizers": _TEMPLATE,
    "conversation_ttl": _SCHEDULER,
    "stateless_ttl": _SCHEDULER,
    "shutdown_grace": (*_SCHEDULER, "http"),
    "step_channel": (),  # `pensieve serve`'s alone
    "turn_log": (*_SCHEDULER, "ingress"),
    "turn_log_replicas": _SCHEDULER,
    "lease_ttl": _SCHEDULER,
    "http_port": _HTTP,
    "http_host": (*_HTTP, "scheduler"),  # the scheduler's: where its --metrics-port listens
    "http_read_timeout": _HTTP,
    "http_max_connections": _HTTP,
    "served_model_name": _HTTP,
    "metrics_port": _SCHEDULER,
    "nats_events_password_file": _SCHEDULER,
}
# the kinds of option (argparse's actions) that the table's options are
_KINDS = (None, "store", "store_true", "store_false")


def actor_parser(commands: Any, summary: str, run: Callable[..., int]) -> None:
    """`pensieve actor`, and under it one parser for each actor."""
    actor = commands.add_parser(
        "actor",
        help=summary,
        description="Run one actor of an engine, meeting the others on the NATS server at "
        "--nats-url; give every actor of one engine the same --data-dir, and each waits for "
        "the others. `pensieve actor NAME --help` lists the options NAME takes.",
        formatter_class=HelpFormatter,
    )
    names = actor.add_subparsers(dest="name", required=True)
    for name, does in ACTORS.items():
        one = names.add_parser(
            name,
            help=does,
            description=f"The {name} actor: {does}.",
            formatter_class=HelpFormatter,
        )
        for kind in _KINDS:  # an option of the table that `name` leaves alone is refused
            one.register("action", kind, _only_for(name, one._registry_get("action", kind)))
        engine_args(one, model_required=name in _MODEL)
        server_args(one, embedded=False)
        nats_auth_args(one, embedded=False)
        log_arg(one)
        one.set_defaults(run=run)


def _only_for(actor: str, kind: type[argparse.Action]) -> Callable[..., argparse.Action]:
    """What makes an option of kind `kind`: itself where `actor` takes it, else `_NotTaken`."""

    def make(**kwargs: Any) -> argparse.Action:
        made = kind(**kwargs)
        takers = TAKEN_BY.get(made.dest)
        if takers is None or actor in takers:
            return made
        return _NotTaken(made.option_strings, made.dest, made.default, actor, takers)

    return make


class _NotTaken(argparse.Action):
    """An option of `pensieve serve` that the actor does not use: hidden from its help, and
    refused; its default stays, for the options the actors are built from."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        default: Any,
        actor: str,
        takers: tuple[str, ...],
    ) -> None:
        super().__init__(option_strings, dest, nargs="?", default=default, help=argparse.SUPPRESS)
        self.actor, self.takers = actor, takers

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error(
            f"{self.option_strings[0]} does not apply to `pensieve actor {self.actor}`: "
            f"{_who(self.takers)}"
        )


def _who(takers: tuple[str, ...]) -> str:
    if not takers:
        return "`pensieve serve` takes it"
    if len(takers) == 1:
        return f"`pensieve actor {takers[0]}` takes it"
    return f"the {', '.join(takers[:-1])} and {takers[-1]} actors take it"
