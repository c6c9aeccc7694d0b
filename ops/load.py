"""Load for a running `pensieve serve`, sent over NATS as clients send it (`pensieve bench`), or
over the OpenAI API (`ops/openai_client.py`, `pensieve bench --http`).

ShareGPT conversations, each human message one streamed turn on `pensieve.v1.chat` (the first
without a conversation id, the next ones with the id the first reply gave), sent when the
previous reply is complete: K conversations at once (closed loop, `run_load`), or new ones
arriving as a Poisson process with a think time before each next turn (`run_poisson`). The
time to the first streamed delta is the time to first token. At the end: turns, output tokens
per second, time to first token, latency and normalized latency (latency / output tokens)
percentiles, what `vllm bench serve` reports under its names (`ops/load_report.py`), prompt
tokens by where their KV came from, errors by code, and (`server`) what the
engine's own totals on `pensieve.v1.stats` moved by meanwhile: token sources and swap volumes
and rates.

    python3 -m pensieve.ops.load --nats-url nats://127.0.0.1:4222 [sharegpt]
        [--num-conversations 32] [--max-turns 3] [--max-tokens 128] [--concurrency 8]
        [--ignore-eos] [--probe-every S] [--json OUT]

`pensieve replay` with the same conversations, turns, token limit and concurrency runs the
same work on the engine directly, without NATS: the two summaries side by side show what the
serving layer costs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
import orjson

from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.replies import PromptSources
from pensieve.ops.load_report import Report, Request, serving_metrics
from pensieve.ops.sharegpt import Conversation, Role, human_turns, load_conversations


@dataclass(frozen=True)
class LoadOptions:
    concurrency: int = 8
    max_turns: int = 3
    max_tokens: int = 128
    ignore_eos: bool = False
    stream: bool = True  # else the time to first token is the whole latency
    timeout_s: float = 600.0
    # seconds between management requests (stats, list, get) sent beside the load, whose
    # latencies the summary reports (0: none)
    probe_every_s: float = 0.2
    final: bool = False  # each conversation's last turn says "final": its KV goes at once
    report: Report = Report()  # the `vllm bench serve` figures' percentiles and goodput
    on_turn: Callable[[], None] | None = None  # told after each turn (a progress bar)


@dataclass(frozen=True)
class Window:
    """A timed rate run, measured in a steady state: new conversations arrive for `duration_s`
    (the conversations are taken again from the first once all have arrived), no turn is sent
    after it, and only turns sent from `warmup_s` on count, over the `duration_s - warmup_s`
    seconds between the two."""

    duration_s: float
    warmup_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(
                f"the warm-up ({self.warmup_s:g} s) must be shorter than the run "
                f"({self.duration_s:g} s)"
            )


class ChatClient(Protocol):
    """What the load talks to the server through: NATS (`NatsClient`), or the OpenAI API
    (`ops/openai_client.py`)."""

    @property
    def bus(self) -> Bus | None:
        """For the management probes and the engine's stats (None: none)."""
        ...

    def turn(self, body: dict[str, Any], timeout_s: float) -> AsyncGenerator[dict[str, Any], None]:
        """Send one `pensieve.v1.chat` request; yield each message of its answer as the client
        API has it: streamed deltas, then the reply (or an error)."""
        ...


@dataclass(frozen=True)
class NatsClient:
    bus: Bus

    async def turn(
        self, body: dict[str, Any], timeout_s: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        asked = self.bus.ask(subjects.CHAT, orjson.dumps(body), timeout_s)
        async with aclosing(asked) as answer:
            async for data in answer:
                yield orjson.loads(data)


def _client(target: Bus | ChatClient) -> ChatClient:
    return NatsClient(target) if isinstance(target, Bus) else target


async def _stats(client: ChatClient) -> dict[str, Any] | None:
    return None if client.bus is None else await server_stats(client.bus)


@dataclass
class _Turns:
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    normalized: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    sources: list[dict[str, int]] = field(default_factory=list)  # each reply's prompt_sources
    errors: Counter[str] = field(default_factory=Counter)
    requests: list[Request] = field(default_factory=list)


async def run_load(
    target: Bus | ChatClient, conversations: list[Conversation], options: LoadOptions
) -> dict[str, Any]:
    """Send every conversation's turns through `target`; returns the summary."""
    pending = list(reversed(conversations))
    turns = _Turns()
    chat = _client(target)

    async def client() -> None:
        while pending:
            await _conversation(chat, pending.pop(), options, turns)

    before = await _stats(chat)
    begin = time.perf_counter()
    probes: dict[str, list[float]] = {"stats": [], "list": [], "get": []}
    every_s = options.probe_every_s if chat.bus is not None else 0.0
    probing = asyncio.ensure_future(_probe(chat.bus, every_s, probes))
    await asyncio.gather(*(client() for _ in range(options.concurrency)))
    probing.cancel()
    summary = _summary(turns, time.perf_counter() - begin, options.report)
    summary["concurrency"] = options.concurrency
    summary["management_s"] = {
        name: {"n": len(values), "p50": _percentile(values, 0.5), "p99": _percentile(values, 0.99)}
        for name, values in probes.items()
    }
    after = await _stats(chat)
    if before is not None and after is not None and before["engine_id"] == after["engine_id"]:
        summary["server"] = server_moved(before, after)
    return summary


async def run_poisson(
    target: Bus | ChatClient,
    conversations: list[Conversation],
    options: LoadOptions,
    rate: float,
    think_s: float,
    seed: int = 0,
    window: Window | None = None,
) -> dict[str, Any]:
    """New conversations arrive `rate` a second (a Poisson process), each next turn is sent a
    think time after the reply before it (exponential, mean `think_s`); returns the summary.
    Without `window` every conversation arrives once and every turn counts."""
    draw = random.Random(seed)
    turns = _Turns()
    chat = _client(target)
    before = await _stats(chat)
    begin = time.perf_counter()
    sent = Sent(begin + window.warmup_s, begin + window.duration_s) if window else Sent()
    talking = []
    for conv in itertools.cycle(conversations) if window else conversations:
        if time.perf_counter() >= sent.until:
            break
        pause = draw.expovariate(1 / think_s) if think_s > 0 else 0.0
        talking.append(
            asyncio.ensure_future(_conversation(chat, conv, options, turns, pause, sent))
        )
        await asyncio.sleep(draw.expovariate(rate))
    await asyncio.gather(*talking)
    seconds = window.duration_s - window.warmup_s if window else time.perf_counter() - begin
    summary = _summary(turns, seconds, options.report)
    summary |= {"request_rate": rate, "think_s": think_s}
    if window is not None:
        summary["window_s"] = [window.warmup_s, window.duration_s]
    after = await _stats(chat)
    if before is not None and after is not None and before["engine_id"] == after["engine_id"]:
        summary["server"] = server_moved(before, after)
    return summary


async def _probe(bus: Bus | None, every_s: float, latencies: dict[str, list[float]]) -> None:
    """Management requests beside the load, one every `every_s`, round robin: how long each
    waits for its answer while turns run."""
    if every_s <= 0 or bus is None:
        return
    conv_id: str | None = None
    for i in itertools.count():
        name = ("stats", "list", "get")[i % 3]
        subject, body = {
            "stats": (subjects.STATS, {}),
            "list": (subjects.CONVERSATIONS_LIST, {"limit": 10}),
            "get": (subjects.CONVERSATIONS_GET, {"conversation_id": conv_id, "limit": 10}),
        }[name]
        if name == "get" and conv_id is None:
            await asyncio.sleep(every_s)
            continue
        begin = time.perf_counter()
        try:
            async with aclosing(bus.ask(subject, orjson.dumps(body), timeout=30.0)) as answer:
                reply = orjson.loads(await anext(answer))
        except (TimeoutError, ConnectionError):
            reply = None
        latencies[name].append(time.perf_counter() - begin)
        if name == "list" and reply and reply.get("conversations"):
            conv_id = reply["conversations"][0]
        await asyncio.sleep(every_s)


async def server_stats(bus: Bus, fresh_within_s: float = 2.0) -> dict[str, Any] | None:
    """`pensieve.v1.stats` of the engine that answers (None if none does, e.g. an older one).

    An engine inside a step answers with a snapshot (`age_s` > 0) that may miss the turns whose
    replies just went out; it is asked again until its figures are of now (`age_s` 0) or
    `fresh_within_s` has passed, so totals compared across a load are exact."""
    deadline = time.monotonic() + fresh_within_s
    while True:
        try:
            async with aclosing(bus.ask(subjects.STATS, b"{}", timeout=30.0)) as answer:
                body = orjson.loads(await anext(answer))
        except (TimeoutError, ConnectionError, StopAsyncIteration):
            return None
        if "error" in body:
            return None
        if not body.get("age_s") or time.monotonic() >= deadline:
            return dict(body)
        await asyncio.sleep(0.01)


def slowest_between(
    before: dict[str, Any], after: dict[str, Any], kind: str = "slowest", keep: int = 8
) -> list[Any]:
    """The `keep` longest step intervals (or event loop stalls, `kind="loop_stalls"`) of the
    engine's log (stats' `slow_steps`, longest first) that ended after `before`'s was read:
    those of the load, not of a warm-up; each with `run_s`, when it ended from that read (about
    when the load began)."""
    since = before["now_s"]
    return [
        {**found, "run_s": found["at_s"] - since} for found in after[kind] if found["at_s"] > since
    ][:keep]


def server_moved(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engine did during the load, by its own totals: requests finished, suspensions,
    prompt tokens by source, and swaps in each direction with their rate over the device time
    the copies took. With one engine on the bus and no other client, its prompt sources add up
    the replies' `prompt_sources`."""

    def moved(a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            return {k: moved(a[k], b[k]) for k in a if k in b}
        return a - b

    requests = after["requests"]
    out: dict[str, Any] = {
        "engine_id": after["engine_id"],
        "requests_finished": requests["finished"] - before["requests"]["finished"],
        "suspensions": requests["suspensions"] - before["requests"]["suspensions"],
        "tokens": moved(after["tokens"], before["tokens"]),
        "swaps": moved(after["swaps"], before["swaps"]),
    }
    if "device" in after and "device" in before:  # device time in steps and idle between them
        device = moved(after["device"], before["device"])
        total = device["busy_s"] + device["idle_s"]
        out["device"] = {**device, "idle_fraction": device["idle_s"] / total if total else None}
    for swap in out["swaps"].values():
        swap["gb_per_s"] = swap["bytes"] / swap["seconds"] / 1e9 if swap["seconds"] > 0 else None
    if "slow_steps" in after and "slow_steps" in before:
        out["slow_steps"] = slowest_between(before["slow_steps"], after["slow_steps"])
        out["loop_stalls"] = slowest_between(
            before["slow_steps"], after["slow_steps"], "loop_stalls"
        )
    if "prefix_cache" in after and "prefix_cache" in before:  # counters moved; the rest as after
        cache, was = after["prefix_cache"], before["prefix_cache"]
        out["prefix_cache"] = {
            **cache,
            **{k: cache[k] - was[k] for k in ("queries", "hits", "shared_hits")},
        }
    saves, saved = (s.get("cache", {}).get("disk_saves") for s in (after, before))
    if saves is not None and saved is not None:  # chunks saved for the disk tier, by when
        out["disk_saves"] = moved(saves, saved)
    if after.get("prefill_budget") is not None:  # the step-time ratios as they ended
        out["prefill_budget"] = after["prefill_budget"]
    return out


@dataclass(frozen=True)
class Sent:
    """Which turns a run sends, and which of them count: those sent from `counted_from` on
    (perf_counter seconds); none is sent from `until` on."""

    counted_from: float = -math.inf
    until: float = math.inf


async def _conversation(
    chat: ChatClient,
    conv: Conversation,
    options: LoadOptions,
    turns: _Turns,
    think_s: float = 0.0,
    sent: Sent = Sent(),
) -> None:
    """The conversation's turns one after the other, `think_s` between a reply and the next."""
    conversation_id = None
    system = [
        {"role": "system", "content": m.text} for m in conv.turns[:1] if m.role is Role.SYSTEM
    ]
    chosen = list(human_turns(conv))[: options.max_turns]
    for i, turn in enumerate(chosen):
        body: dict[str, Any] = {
            "max_tokens": options.max_tokens,
            "ignore_eos": options.ignore_eos,
            "stream": options.stream,
        }
        if options.final and i == len(chosen) - 1:
            body["final"] = True
        if conversation_id is not None:
            body |= {"conversation_id": conversation_id, "message": turn.text}
        elif system:  # as `pensieve replay` renders it
            body["messages"] = [*system, {"role": "user", "content": turn.text}]
        else:
            body["message"] = turn.text
        if i and think_s:
            await asyncio.sleep(think_s)
        begin = time.perf_counter()
        if begin >= sent.until:
            return
        arrived: list[float] = []
        reply: dict[str, Any] = {}
        async with aclosing(chat.turn(body, options.timeout_s)) as answer:
            async for reply in answer:
                if "delta" not in reply:
                    break
                arrived.append(time.perf_counter())
        done = time.perf_counter()
        counted = begin >= sent.counted_from
        if "error" in reply:
            if counted:
                turns.errors[reply["error"]["code"]] += 1
            return  # the conversation cannot go on without this turn
        conversation_id = reply["conversation_id"]
        if options.on_turn is not None:
            options.on_turn()
        if not counted:  # sent while the server was still filling up
            continue
        usage = reply["usage"]
        request = Request(
            begin, tuple(arrived), done, usage["prompt_tokens"], usage["completion_tokens"], i
        )
        turns.requests.append(request)
        turns.ttft.append(request.ttft_s)
        turns.latency.append(done - begin)
        turns.normalized.append((done - begin) / max(usage["completion_tokens"], 1))
        turns.output_tokens += usage["completion_tokens"]
        turns.prompt_tokens += usage["prompt_tokens"]
        turns.sources.append(usage["prompt_sources"])


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(turns: _Turns, seconds: float, report: Report) -> dict[str, Any]:
    sources = PromptSources.total(turns.sources)
    return {
        "turns": len(turns.latency),
        "errors": dict(turns.errors),
        "seconds": seconds,
        "output_tokens": turns.output_tokens,
        "output_tok_per_s": turns.output_tokens / seconds if seconds else 0.0,
        "turns_per_s": len(turns.latency) / seconds if seconds else 0.0,
        "prompt_tokens": turns.prompt_tokens,
        "cached_tokens": sources.cached,
        "prompt_sources": msgspec.structs.asdict(sources),
        "new_prompt_tokens": sources.new,
        "ttft_s_mean": sum(turns.ttft) / len(turns.ttft) if turns.ttft else None,
        **{
            f"{name}_p{int(q * 100)}": _percentile(values, q)
            for name, values in (
                ("ttft_s", turns.ttft),
                ("latency_s", turns.latency),
                ("norm_latency_s", turns.normalized),
            )
            for q in (0.5, 0.9)
        },
        **serving_metrics(turns.requests, sum(turns.errors.values()), seconds, report),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("conversations", nargs="?", default="sharegpt", help="file, or 'sharegpt'")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--num-conversations", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-stream", action="store_true", help="whole replies only")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument(
        "--final",
        action="store_true",
        help='send each conversation\'s last turn with "final": true',
    )
    p.add_argument(
        "--probe-every",
        type=float,
        default=0.2,
        metavar="S",
        help="send stats, list and get beside the load every S seconds (0: none)",
    )
    args = p.parse_args(argv)
    conversations = load_conversations(args.conversations, args.num_conversations)
    options = LoadOptions(
        args.concurrency,
        args.max_turns,
        args.max_tokens,
        args.ignore_eos,
        not args.no_stream,
        probe_every_s=args.probe_every,
        final=args.final,
    )

    async def go() -> dict[str, Any]:
        bus = await Bus.connect(args.nats_url, name="pensieve-load")
        try:
            return await run_load(bus, conversations, options)
        finally:
            await bus.close()

    summary = asyncio.run(go())
    text = orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0 if summary["turns"] else 1


if __name__ == "__main__":
    sys.exit(main())
