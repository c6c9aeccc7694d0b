"""Agentic sessions (`ops/agentic.py`) sent to a running server, and what it served them with.

Each session sends its turns one after the other: a turn is sent once the reply before it has
come and the tool time after that reply has passed. Closed loop (`run_closed`): N sessions at
once, the next one starting when one ends. Open loop (`run_open`): sessions arrive as a Poisson
process. Every turn streams; its time to first token is the time to the first streamed chunk.

A stateful client (`History.STATEFUL`, NATS) sends the first turn's whole chat and then only
each new message with the conversation's id; a client that resends its history
(`History.RESENT`, as agent frameworks drive the OpenAI API) sends the whole chat every turn,
its replies as they came, and names no conversation.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pensieve.ops.agentic import Session, Workload
from pensieve.ops.load import ChatClient, server_moved, server_stats

SOURCES = ("gpu", "cpu", "recomputed")


class History(enum.Enum):
    STATEFUL = "stateful"
    RESENT = "resent"


@dataclass(frozen=True)
class Slo:
    """The objective a turn meets to count in the goodput."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("the service objectives must be positive")


@dataclass(frozen=True)
class AgenticOptions:
    history: History = History.STATEFUL
    ignore_eos: bool = True  # every reply as long as the session asked
    slo: Slo = Slo()
    timeout_s: float = 600.0
    on_turn: Callable[[], None] | None = None  # told after each turn (a progress bar)


@dataclass(frozen=True)
class TurnResult:
    session: str
    index: int  # counts from 0 within the session
    ttft_s: float
    latency_s: float
    gaps_s: tuple[float, ...]  # between streamed chunks
    prompt_tokens: int
    completion_tokens: int
    cached: dict[str, int]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with one token)."""
        if self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)

    def meets(self, slo: Slo) -> bool:
        tpot = self.tpot_s
        return self.ttft_s <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


@dataclass
class Outcome:
    """What a run's sessions did: each finished turn, and how sessions ended."""

    turns: list[TurnResult] = field(default_factory=list)
    started: int = 0
    completed: set[str] = field(default_factory=set)
    session_s: list[float] = field(default_factory=list)  # each completed session, end to end
    errors: Counter[str] = field(default_factory=Counter)


async def run_closed(
    chat: ChatClient, workload: Workload, concurrency: int, options: AgenticOptions
) -> dict[str, Any]:
    """Every session through `chat`, `concurrency` at once; returns the summary."""
    pending = list(reversed(workload.sessions))
    outcome = Outcome()

    async def slot() -> None:
        while pending:
            await _session(chat, workload, pending.pop(), options, outcome)

    summary = await _measured(chat, outcome, options, [slot() for _ in range(concurrency)])
    return {"concurrency": concurrency, **summary}


async def run_open(
    chat: ChatClient, workload: Workload, rate: float, seed: int, options: AgenticOptions
) -> dict[str, Any]:
    """Sessions arrive `rate` a second (a Poisson process drawn from `seed`), each once;
    returns the summary."""
    draw = random.Random(seed)
    outcome = Outcome()

    async def arrivals() -> None:
        started = []
        for index, session in enumerate(workload.sessions):
            if index:
                await asyncio.sleep(draw.expovariate(rate))
            started.append(
                asyncio.ensure_future(_session(chat, workload, session, options, outcome))
            )
        await asyncio.gather(*started)

    summary = await _measured(chat, outcome, options, [arrivals()])
    return {"session_rate": rate, **summary}


async def _measured(
    chat: ChatClient,
    outcome: Outcome,
    options: AgenticOptions,
    work: list[Coroutine[Any, Any, None]],
) -> dict[str, Any]:
    """Run `work` to its end; the summary of `outcome`, with what the engine counted meanwhile
    (over NATS)."""
    before = None if chat.bus is None else await server_stats(chat.bus)
    begin = time.perf_counter()
    await asyncio.gather(*work)
    summary = summarize(outcome, time.perf_counter() - begin, options.slo)
    after = None if chat.bus is None else await server_stats(chat.bus)
    if before is not None and after is not None and before["engine_id"] == after["engine_id"]:
        summary["server"] = server_moved(before, after)
    return summary


async def _session(
    chat: ChatClient,
    workload: Workload,
    session: Session,
    options: AgenticOptions,
    outcome: Outcome,
) -> None:
    replies: list[str] = []
    conversation_id = None
    begin = time.perf_counter()
    outcome.started += 1
    for index, turn in enumerate(session.turns):
        body: dict[str, Any] = {
            "max_tokens": turn.max_tokens,
            "ignore_eos": options.ignore_eos,
            "stream": True,
        }
        if conversation_id is None or options.history is History.RESENT:
            body["messages"] = session.messages(workload.system, replies)
        else:
            body |= {"conversation_id": conversation_id, "message": turn.text}
        sent = time.perf_counter()
        arrived: list[float] = []
        text: list[str] = []
        reply: dict[str, Any] = {}
        async with aclosing(chat.turn(body, options.timeout_s)) as answer:
            async for reply in answer:
                if "delta" not in reply:
                    break
                arrived.append(time.perf_counter())
                text.append(reply["delta"])
        done = time.perf_counter()
        if "error" in reply or "usage" not in reply:
            outcome.errors[reply.get("error", {}).get("code", "no_reply")] += 1
            return  # the session cannot go on without this turn
        conversation_id = reply["conversation_id"]
        replies.append("".join(text))
        usage = reply["usage"]
        outcome.turns.append(
            TurnResult(
                session.id,
                index,
                (arrived[0] if arrived else done) - sent,
                done - sent,
                tuple(b - a for a, b in zip(arrived, arrived[1:], strict=False)),
                usage["prompt_tokens"],
                usage["completion_tokens"],
                {k: usage["cached_tokens"].get(k, 0) for k in SOURCES},
            )
        )
        if options.on_turn is not None:
            options.on_turn()
        if turn.tool_time_s:
            await asyncio.sleep(turn.tool_time_s)
    outcome.completed.add(session.id)
    outcome.session_s.append(time.perf_counter() - begin)


def stats(values: list[float]) -> dict[str, float] | None:
    """Mean, median, p90 and p99 (None: no values)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(outcome: Outcome, seconds: float, slo: Slo) -> dict[str, Any]:
    turns = outcome.turns
    prompt = sum(t.prompt_tokens for t in turns)
    output = sum(t.completion_tokens for t in turns)
    cached = {k: sum(t.cached[k] for t in turns) for k in SOURCES}
    new = prompt - sum(cached.values())
    missed = {t.session for t in turns if not t.meets(slo)}
    good_sessions = len(outcome.completed - missed)
    good_turns = sum(t.meets(slo) for t in turns)

    def per_s(n: float) -> float:
        return n / seconds if seconds > 0 else 0.0

    return {
        "sessions": outcome.started,
        "sessions_completed": len(outcome.completed),
        "turns": len(turns),
        "errors": dict(outcome.errors),
        "seconds": seconds,
        "turns_per_s": per_s(len(turns)),
        "output_tokens": output,
        "output_tok_per_s": per_s(output),
        "prompt_tokens": prompt,
        "input_tok_per_s": per_s(prompt),
        "cached_tokens": cached,
        "new_prompt_tokens": new,
        "prompt_share": {
            k: v / prompt if prompt else 0.0 for k, v in {**cached, "new": new}.items()
        },
        "ttft_first_s": stats([t.ttft_s for t in turns if t.index == 0]),
        "ttft_later_s": stats([t.ttft_s for t in turns if t.index > 0]),
        "tpot_s": stats([s for t in turns if (s := t.tpot_s) is not None]),
        "itl_s": stats([gap for t in turns for gap in t.gaps_s]),
        "latency_s": stats([t.latency_s for t in turns]),
        "session_s": stats(outcome.session_s),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput": {
            "turns_per_s": per_s(good_turns),
            "turns_share": good_turns / len(turns) if turns else 0.0,
            "sessions_per_s": per_s(good_sessions),
            "sessions_share": good_sessions / outcome.started if outcome.started else 0.0,
        },
    }
