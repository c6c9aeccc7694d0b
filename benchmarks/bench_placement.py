"""Placement among engines on one NATS: two engines against one, and the ingress's policies
(`pensieve serve --placement prefix|load|random`, docs/many-engines.md), one engine per GPU.

    python3 -m benchmarks.bench_placement --model M [--gpus 0,1]
        [--runs 1:prefix,2:random,2:load,2:prefix] [--workload stateful|resent]
        [--conversations sharegpt|FILE|synthetic] [--num-conversations 64] [--concurrency 16]
        [--max-turns 4] [--max-tokens 128] [--conversations-per-client K] [--json OUT]
        [--serve-option=--gpu-cache-gb=20 ...]

Each run starts a nats-server and N `pensieve serve` processes (engine i with
CUDA_VISIBLE_DEVICES=<i-th of --gpus>, a data dir of its own), sends the load of
`pensieve.ops.load` through the shared subjects (any engine's ingress answers; placement
decides), and prints one line: turns/s, output tokens/s, TTFT p50 and p90, and the share of
prompt tokens served from the cache (`--json`: each run's whole `pensieve.ops.load` summary).

- `stateful`: each conversation names its id after its first turn (it stays with its engine).
- `resent`: each client resends its whole history every turn with no conversation id, as a
  stateless OpenAI client does: every turn is placed, and prefix-aware placement against random
  shows in the cache hit share and the TTFT. The history carries the replies the dataset
  recorded (`--replies recorded`, the default), as a benchmark replaying a dataset does: a
  model with random weights (`preset:`) replies with token ids whose text does not encode back
  to them, so resending its own replies (`--replies generated`) would leave nothing after the
  first reply for any placement to find.

`synthetic` conversations (no dataset needed): 8 groups, each with a long system prompt of its
own, so that many conversations share a prefix. `--cpu` runs the engines on the CPU
(`--cpu-threads 1`): a check that the script runs end to end, not a figure.

`--per-engine` makes `--concurrency` the clients per engine (N engines, N x the clients): each
engine meets the load one engine meets alone, so turns/s of two against one is the capacity
ratio. A list (`--concurrency 64,128,256`) is a sweep: each run's engines meet the levels in
turn, each level with conversations of its own (`--conversations-per-client K`: K a client),
one result per level.

`--failover S` (runs of two engines or more): the engines keep a turn log on JetStream
(`--turn-log jetstream`, the server started with JetStream), the clients send each turn again
while it is refused `unavailable` or silent for `--silence S` (saying the turn number, so a copy
is never committed twice), and engine 0 is killed (SIGKILL) S seconds into the load (later if
it has answered no turn by then). The line then adds, over the conversations engine 0 owned:
the time from the kill to each one's next turn's first token and to its last (answered by the
engine that adopted it), that turn's time to first token from the copy answered, and the
acknowledged turns the log lacks after it (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.ops.engine_process import EngineProcess
from pensieve.ops.load import ChatClient, LoadOptions, NatsClient, run_load
from pensieve.ops.load_report import add_report_args, percentile, report_of
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.ops.sharegpt import Conversation, Message, Role, human_turns, load_conversations


@dataclass
class ResendingClient:
    """Turns of stateful conversations sent as a stateless client sends them: the whole history
    each time, no conversation id (the load generator still sees one id per conversation: the
    first turn's). With `recorded` (a human message's text -> the reply the dataset recorded
    after it), the history carries the recorded replies, as a benchmark replaying a dataset
    does; otherwise the engine's own replies as it gave them."""

    client: ChatClient
    recorded: dict[str, str] = field(default_factory=dict)
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
                text = self.recorded.get(messages[-1]["content"], reply["text"])
                self.histories[conv_id] = [*messages, {"role": "assistant", "content": text}]
                reply = {**reply, "conversation_id": conv_id}
            yield reply


def recorded_replies(conversations: list[Conversation]) -> dict[str, str]:
    """Each human message's recorded reply, by the message's text (the first one recorded,
    where a text repeats)."""
    replies: dict[str, str] = {}
    for conv in conversations:
        for turn in human_turns(conv):
            if turn.reply is not None:
                replies.setdefault(turn.text, turn.reply)
    return replies


@dataclass
class Failover:
    """Engine `victim` is killed at `killed_at` (perf_counter s); what its conversations met."""

    victim: str = ""
    killed_at: float | None = None
    # conversation id -> (kill to its next turn's first token, kill to that turn answered, the
    # turn's time to first token from the copy answered), s
    recovered: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    acknowledged: dict[str, int] = field(default_factory=dict)  # conversation id -> turns
    owned_at_kill: dict[str, int] = field(default_factory=dict)  # the victim's, as killed
    retries: int = 0


@dataclass
class RetryingClient:
    """Each turn sent again while the engines answer `unavailable` or fall silent for
    `silence_s` (an engine killed in the middle of it), with the turn number it must get, so a
    copy is never committed twice; what the victim's conversations met is kept in `failover`.
    A turn whose copies all fail for `timeout_s` ends in `unavailable`. A turn answered again
    streams its deltas again: the load counts its time to first token from the first copy, and
    its inter-token times over both."""

    client: ChatClient
    silence_s: float
    failover: Failover

    @property
    def bus(self) -> Bus | None:
        return self.client.bus

    async def turn(
        self, body: dict[str, Any], timeout_s: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        conv_id = body.get("conversation_id")
        done = self.failover.acknowledged
        if conv_id is not None:
            body = {**body, "turn": done[conv_id]}
        deadline = time.perf_counter() + timeout_s
        while True:
            sent = time.perf_counter()
            first: float | None = None
            reply: dict[str, Any] = {"error": {"code": "unavailable"}}
            try:
                async for reply in self.client.turn(dict(body), self.silence_s):
                    if "delta" not in reply:
                        break
                    first = first or time.perf_counter()
                    yield reply
            except (TimeoutError, ConnectionError):
                reply = {"error": {"code": "unavailable"}}
            code = reply.get("error", {}).get("code")
            if code != "unavailable" or time.perf_counter() > deadline:
                break
            self.failover.retries += 1
            await asyncio.sleep(0.2)
        if "error" not in reply:
            conv_id = reply["conversation_id"]
            done[conv_id] = done.get(conv_id, 0) + 1
            self._recovered(conv_id, sent, first)
        yield reply

    def _recovered(self, conv_id: str, sent: float, first: float | None) -> None:
        killed, answered = self.failover.killed_at, time.perf_counter()
        if killed is None or sent < killed or conv_id in self.failover.recovered:
            return  # a reply already on its way as the victim died is not a recovery
        if conv_id in self.failover.owned_at_kill:
            first = first or answered
            self.failover.recovered[conv_id] = (first - killed, answered - killed, first - sent)


def synthetic(
    num: int, max_turns: int, num_groups: int = 8, num_rules: int = 60
) -> list[Conversation]:
    """`num` conversations in `num_groups` groups; a group's share a system prompt of
    `num_rules` rules (~16 tokens each). Each question has a recorded reply of ~110 tokens."""

    def system(group: int) -> str:
        return f"You are assistant {group}. " + " ".join(
            f"Rule {i}: answer question {i} about topic {group} in one short sentence."
            for i in range(num_rules)
        )

    def recorded(client: int, item: int) -> str:
        return f"Item {item} for client {client}: " + " ".join(
            f"point {j} of item {item} holds for client {client}." for j in range(12)
        )

    return [
        Conversation(
            f"s{i}",
            (
                Message(Role.SYSTEM, system(i % num_groups)),
                *(
                    message
                    for t in range(max_turns)
                    for message in (
                        Message(Role.HUMAN, f"Question {t} of client {i}: tell me about item {t}."),
                        Message(Role.GPT, recorded(i, t)),
                    )
                ),
            ),
        )
        for i in range(num)
    ]


async def _load(
    url: str,
    conversations: list[Conversation],
    concurrency: int,
    args: argparse.Namespace,
    victim: EngineProcess | None,
) -> Any:
    bus = await Bus.connect(url, "pensieve-bench")
    try:
        client: ChatClient = NatsClient(bus)
        failover = Failover()
        if victim is not None:
            client = RetryingClient(client, args.silence, failover)
        recorded = recorded_replies(conversations) if args.replies == "recorded" else {}
        chat = ResendingClient(client, recorded) if args.workload == "resent" else client
        options = LoadOptions(
            concurrency=concurrency,
            max_turns=args.max_turns,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            probe_every_s=0.0,
            report=report_of(args),
        )
        loading = asyncio.ensure_future(run_load(chat, conversations, options))
        if victim is not None:  # killed S s in, once it has answered a turn
            await asyncio.wait({loading}, timeout=args.failover)
            while not loading.done() and victim.engine_id not in map(
                subjects.owner, failover.acknowledged
            ):
                await asyncio.sleep(0.05)
            failover.victim = victim.engine_id
            failover.owned_at_kill = {
                conv_id: turns
                for conv_id, turns in failover.acknowledged.items()
                if subjects.owner(conv_id) == victim.engine_id
            }
            failover.killed_at = time.perf_counter()
            await asyncio.to_thread(victim.kill)
        summary = await loading
        if victim is not None:
            summary["failover"] = await _failover_summary(bus, failover, args.silence)
        return summary
    finally:
        await bus.close()


async def _failover_summary(bus: Bus, failover: Failover, silence_s: float) -> dict[str, Any]:
    """What the victim's conversations met, and the acknowledged turns the log lacks."""
    lost = 0
    for conv_id in failover.owned_at_kill:
        asked = await bus.asking(
            subjects.CONVERSATIONS_GET, orjson.dumps({"conversation_id": conv_id}), 30.0
        )
        try:
            got = orjson.loads(await asked.next())
        finally:
            await asked.close()
        stored = 0 if "error" in got else got["num_turns"]
        lost += max(0, failover.acknowledged[conv_id] - stored)

    def spread(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50": None, "p90": None, "max": None}
        return {"p50": percentile(values, 50), "p90": percentile(values, 90), "max": max(values)}

    recovered = list(failover.recovered.values())
    return {
        "victim": failover.victim,
        "conversations": len(failover.owned_at_kill),
        "recovered": len(recovered),
        "kill_to_first_token_s": spread([r[0] for r in recovered]),
        "kill_to_answer_s": spread([r[1] for r in recovered]),
        "recovered_ttft_s": spread([r[2] for r in recovered]),
        "lost_turns": lost,
        "retries": failover.retries,
        "silence_s": silence_s,
    }


def clients(level: int, num_engines: int, args: argparse.Namespace) -> int:
    return level * (num_engines if args.per_engine else 1)


def level_sizes(num_engines: int, args: argparse.Namespace) -> list[int]:
    """How many conversations each load level of a run sends: `--num-conversations`, or
    `--conversations-per-client` times the level's clients."""
    per_client = args.conversations_per_client
    return [
        args.num_conversations if per_client is None else per_client * clients(c, num_engines, args)
        for c in args.concurrency
    ]


def run(
    num_engines: int, policy: str, args: argparse.Namespace, folder: Path
) -> Iterator[dict[str, Any]]:
    """One result per load level of `--concurrency`, the engines started once for them all;
    each level sends conversations of its own (the next ones of the dataset), so that no level
    finds another's prompts in the cache."""
    options = ["--model", args.model, "--placement", policy, *args.serve_option]
    if args.cpu:
        options += ["--cpu-threads", "1", "--tokenizers", "1"]
    gpus = args.gpus.split(",")
    sizes = level_sizes(num_engines, args)
    if args.conversations == "synthetic":
        conversations = synthetic(sum(sizes), args.max_turns, num_rules=args.system_rules)
    else:
        conversations = load_conversations(args.conversations, sum(sizes))
    failover = args.failover is not None and num_engines > 1
    if failover:
        options += ["--turn-log", "jetstream", "--lease-ttl", str(args.lease_ttl)]
    run_dir = folder / f"{num_engines}-{policy}"
    with EmbeddedNats(jetstream_dir=run_dir / "jetstream" if failover else None) as nats_server:
        begin = time.perf_counter()
        engines = [
            EngineProcess(nats_server.url, run_dir / str(i), options, None if args.cpu else gpus[i])
            for i in range(num_engines)
        ]
        try:
            ids = [engine.wait_ready(900.0) for engine in engines]
            _say(f"{num_engines} x {policy}: engines ready in {time.perf_counter() - begin:.0f} s")
            time.sleep(2.0)  # every ingress hears every engine's load report
            victim = engines[0] if failover else None
            start = 0
            for level, size in zip(args.concurrency, sizes, strict=True):
                begin = time.perf_counter()
                summary = asyncio.run(
                    _load(
                        nats_server.url,
                        conversations[start : start + size],
                        clients(level, num_engines, args),
                        args,
                        victim,
                    )
                )
                start += size
                _say(f"  level {level}: {time.perf_counter() - begin:.0f} s")
                hits = summary["cached_tokens"]
                share = hits / summary["prompt_tokens"] if summary["prompt_tokens"] else 0.0
                yield {
                    "engines": num_engines,
                    "policy": policy,
                    "workload": args.workload,
                    "engine_ids": ids,
                    "cache_hit_share": share,
                    **summary,
                }
                victim = None  # killed once, in the first level
        finally:
            begin = time.perf_counter()
            with ThreadPoolExecutor(len(engines)) as stopping:  # they drain side by side
                list(stopping.map(lambda engine: engine.stop(120.0), engines))
            _say(f"  stopped in {time.perf_counter() - begin:.0f} s")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def line(result: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    text = (
        f"{result['engines']} x {result['policy']:<6} {result['workload']:<8} "
        f"clients {result['concurrency']:>3}  "
        f"turns {result['turns']:>4} ({result['turns_per_s']:.2f}/s)  "
        f"out {result['output_tok_per_s']:.1f} tok/s  "
        f"TTFT p50 {s(result['ttft_s_p50'])} p90 {s(result['ttft_s_p90'])} s  "
        f"cached {result['cache_hit_share']:.1%}  errors {sum(result['errors'].values())}"
    )
    if result.get("request_goodput") is not None:
        text += f"  goodput {result['request_goodput']:.2f} req/s"
    failover = result.get("failover")
    if failover is None:
        return text
    first, moved = failover["kill_to_first_token_s"], failover["kill_to_answer_s"]
    ttft = failover["recovered_ttft_s"]
    return (
        f"{text}\n    failover: {failover['recovered']}/{failover['conversations']} of the "
        f"killed engine's conversations answered again, kill to first token p50 "
        f"{s(first['p50'])} p90 {s(first['p90'])} max {s(first['max'])} s, to answer p50 "
        f"{s(moved['p50'])} p90 {s(moved['p90'])} max {s(moved['max'])} s, their TTFT p50 "
        f"{s(ttft['p50'])} p90 {s(ttft['p90'])} s, acknowledged turns lost "
        f"{failover['lost_turns']}, retries {failover['retries']} "
        f"(silence {failover['silence_s']:g} s)"
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
    p.add_argument(
        "--replies",
        choices=["recorded", "generated"],
        default="recorded",
        help="resent: the history carries the dataset's recorded replies, or the engine's own",
    )
    p.add_argument("--conversations", default="synthetic", help="sharegpt, a file, or synthetic")
    p.add_argument("--num-conversations", type=int, default=64)
    p.add_argument(
        "--system-rules", type=int, default=60, help="synthetic: each system prompt's rules"
    )
    p.add_argument(
        "--concurrency",
        type=lambda text: [int(level) for level in text.split(",")],
        default=[16],
        help="clients (in all, or an engine each with --per-engine); a list is a run's load levels",
    )
    p.add_argument(
        "--conversations-per-client",
        type=int,
        default=None,
        help="each load level sends this many conversations a client (not --num-conversations)",
    )
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--per-engine", action="store_true", help="--concurrency clients per engine, not in all"
    )
    p.add_argument(
        "--failover",
        type=float,
        default=None,
        metavar="S",
        help="with two engines or more: a turn log on JetStream, and engine 0 killed S s in",
    )
    p.add_argument("--silence", type=float, default=5.0, help="with --failover: s to resend after")
    p.add_argument("--lease-ttl", type=float, default=2.0, help="with --failover: the engines'")
    p.add_argument("--cpu", action="store_true", help="engines on the CPU: a check, no figure")
    p.add_argument(
        "--serve-option", action="append", default=[], help="passed to every `pensieve serve`"
    )
    add_report_args(p)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pensieve-placement-") as tmp:
        for spec in args.runs.split(","):
            engines, policy = spec.split(":")
            for result in run(int(engines), policy, args, Path(tmp)):
                print(line(result), flush=True)
                results.append(result)
                if args.json is not None:  # after each level: one cut short keeps those before
                    args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
