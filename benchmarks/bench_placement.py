"""Placement among engines on one NATS: two engines against one, and the ingress's policies
(`pensieve serve --placement prefix|load|random`, docs/many-engines.md), one engine per GPU.

    python3 -m benchmarks.bench_placement --model M [--gpus 0,1]
        [--runs 1:prefix,2:random,2:load,2:prefix] [--workload stateful|resent]
        [--conversations sharegpt|FILE|synthetic] [--num-conversations 64] [--concurrency 16]
        [--max-turns 4] [--max-tokens 128] [--json OUT] [--serve-option=--gpu-cache-gb=20 ...]

Each run starts a nats-server and N `pensieve serve` processes (engine i with
CUDA_VISIBLE_DEVICES=<i-th of --gpus>, a data dir of its own), sends the load of
`pensieve.ops.load` through the shared subjects (any engine's ingress answers; placement
decides), and prints one line: turns/s, output tokens/s, TTFT p50 and p90, and the share of
prompt tokens served from the cache (`--json`: each run's whole `pensieve.ops.load` summary).

- `stateful`: each conversation names its id after its first turn (it stays with its engine).
- `resent`: each client resends its whole history every turn with no conversation id, as a
  stateless OpenAI client does: every turn is placed, and prefix-aware placement against random
  shows in the cache hit share and the TTFT.

`synthetic` conversations (no dataset needed): 8 groups, each with a long system prompt of its
own, so that many conversations share a prefix. `--cpu` runs the engines on the CPU
(`--cpu-threads 1`): a check that the script runs end to end, not a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pensieve.actors.wire.bus import Bus
from pensieve.ops.engine_process import EngineProcess
from pensieve.ops.load import LoadOptions, NatsClient, run_load
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.ops.sharegpt import Conversation, Message, Role, load_conversations


@dataclass
class ResendingClient:
    """Turns of stateful conversations sent as a stateless client sends them: the whole history
    each time, no conversation id (the load generator still sees one id per conversation: the
    first turn's)."""

    client: NatsClient
    histories: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def bus(self) -> Bus | None:
        return self.client.bus

    async def turn(
        self, body: dict[str, Any], timeout_s: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        conv_id = body.pop("conversation_id", None)
        if conv_id is None:
            message = body.pop("message", None)
            messages = body.pop("messages", None) or [{"role": "user", "content": message}]
        else:
            messages = [*self.histories[conv_id], {"role": "user", "content": body.pop("message")}]
        async for reply in self.client.turn({**body, "messages": messages}, timeout_s):
            if "delta" not in reply and "error" not in reply:
                conv_id = conv_id or reply["conversation_id"]
                answer = {"role": "assistant", "content": reply["text"]}
                self.histories[conv_id] = [*messages, answer]
                reply = {**reply, "conversation_id": conv_id}
            yield reply


def synthetic(num: int, max_turns: int, num_groups: int = 8) -> list[Conversation]:
    """`num` conversations in `num_groups` groups; a group's share a long system prompt."""

    def system(group: int) -> str:
        return f"You are assistant {group}. " + " ".join(
            f"Rule {i}: answer question {i} about topic {group} in one short sentence."
            for i in range(60)
        )

    return [
        Conversation(
            f"s{i}",
            (
                Message(Role.SYSTEM, system(i % num_groups)),
                *(
                    Message(Role.HUMAN, f"Question {t} of client {i}: tell me about item {t}.")
                    for t in range(max_turns)
                ),
            ),
        )
        for i in range(num)
    ]


async def _load(url: str, conversations: list[Conversation], args: argparse.Namespace) -> Any:
    bus = await Bus.connect(url, "pensieve-bench")
    try:
        client = NatsClient(bus)
        chat = ResendingClient(client) if args.workload == "resent" else client
        options = LoadOptions(
            concurrency=args.concurrency,
            max_turns=args.max_turns,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            probe_every_s=0.0,
        )
        return await run_load(chat, conversations, options)
    finally:
        await bus.close()


def run(num_engines: int, policy: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    options = ["--model", args.model, "--placement", policy, *args.serve_option]
    if args.cpu:
        options += ["--cpu-threads", "1", "--tokenizers", "1"]
    gpus = args.gpus.split(",")
    if args.conversations == "synthetic":
        conversations = synthetic(args.num_conversations, args.max_turns)
    else:
        conversations = load_conversations(args.conversations, args.num_conversations)
    with EmbeddedNats() as nats_server:
        engines = [
            EngineProcess(
                nats_server.url,
                folder / f"{num_engines}-{policy}-{i}",
                options,
                None if args.cpu else gpus[i],
            )
            for i in range(num_engines)
        ]
        try:
            ids = [engine.wait_ready(900.0) for engine in engines]
            time.sleep(2.0)  # every ingress hears every engine's load report
            summary = asyncio.run(_load(nats_server.url, conversations, args))
        finally:
            for engine in engines:
                engine.stop(120.0)
    hits = summary["cached_tokens"]
    return {
        "engines": num_engines,
        "policy": policy,
        "workload": args.workload,
        "engine_ids": ids,
        "cache_hit_share": hits / summary["prompt_tokens"] if summary["prompt_tokens"] else 0.0,
        **summary,
    }


def line(result: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    return (
        f"{result['engines']} x {result['policy']:<6} {result['workload']:<8} "
        f"turns {result['turns']:>4} ({result['turns_per_s']:.2f}/s)  "
        f"out {result['output_tok_per_s']:.1f} tok/s  "
        f"TTFT p50 {s(result['ttft_s_p50'])} p90 {s(result['ttft_s_p90'])} s  "
        f"cached {result['cache_hit_share']:.1%}  errors {sum(result['errors'].values())}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--gpus", default="0,1", help="CUDA devices, engine i on the i-th")
    p.add_argument(
        "--runs",
        default="1:prefix,2:random,2:load,2:prefix",
        help="ENGINES:POLICY, comma-separated",
    )
    p.add_argument("--workload", choices=["stateful", "resent"], default="stateful")
    p.add_argument("--conversations", default="synthetic", help="sharegpt, a file, or synthetic")
    p.add_argument("--num-conversations", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--cpu", action="store_true", help="engines on the CPU: a check, no figure")
    p.add_argument(
        "--serve-option", action="append", default=[], help="passed to every `pensieve serve`"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="pensieve-placement-") as tmp:
        for spec in args.runs.split(","):
            engines, policy = spec.split(":")
            result = run(int(engines), policy, args, Path(tmp))
            print(line(result), flush=True)
            results.append(result)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
