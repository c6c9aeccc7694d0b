"""Agentic sessions (`ops/agentic.py`) sent to a running server, and what it served them with.

Each session sends its turns one after the other: a turn is sent once the reply before it has
come and the tool time after that reply has passed. Closed loop (`run_closed`): N sessions at
once, the next one starting when one ends. Open loop (`run_open`): sessions arrive as a Poisson
process. Every turn streams; its time to first token is the time to the first streamed chunk.

A stateful client (`History.STATEFUL`, NATS) sends the first turn's whole chat and then only
each new message with the conversation's id; a client that resends its history
(`History.RESENT`, as agent frameworks drive the OpenAI API) sends the whole chat every turn
and names no conversation, with its replies as they came (`Replies.GENERATED`) or as the
workload recorded them (`Replies.RECORDED`, as a harness replaying transcripts does).
A run may also send the workload's long prompt, alone, beside the sessions. The summary is
`ops/agentic_summary.py`'s.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pensieve.actors.wire.bus import Bus
from pensieve.ops.agentic import Session, Workload
from pensieve.ops.agentic_summary import (
    LongPromptResult,
    Outcome,
    Slo,
    TurnResult,
    summarize,
)
from pensieve.ops.load import ChatClient, server_moved, server_stats
from pensieve.ops.load_report import Report

LONG_PROMPT_MAX_TOKENS = 8


class History(enum.Enum):
    STATEFUL = "stateful"
    RESENT = "resent"


class Replies(enum.Enum):
    """Which assistant messages a client that resends its history sends."""

    GENERATED = "generated"  # the server's replies, as they came
    RECORDED = "recorded"  # the workload's recorded replies, whatever the server said


@dataclass(frozen=True)
class AgenticOptions:
    history: History = History.STATEFUL
    replies: Replies = Replies.GENERATED
    ignore_eos: bool = True  # every reply as long as the session asked
    slo: Slo = Slo()
    report: Report = Report()  # the `vllm bench serve` figures' percentiles and goodput
    timeout_s: float = 600.0
    on_turn: Callable[[], None] | None = None  # told after each turn (a progress bar)
    cache_salt: str | None = None  # sent with every request: cached prefixes are shared only
    # among requests with the same salt

    def __post_init__(self) -> None:
        if self.replies is Replies.RECORDED and self.history is History.STATEFUL:
            raise ValueError(
                "--replies recorded: a stateful client sends no replies; resend the history "
                "(--http or --resend)"
            )


@dataclass(frozen=True)
class StatsFrom:
    """A `ChatClient` whose turns go through `chat` and whose engine stats come from `bus`
    (the OpenAI API has none)."""

    chat: ChatClient
    bus: Bus

    def turn(self, body: dict[str, Any], timeout_s: float) -> AsyncGenerator[dict[str, Any], None]:
        return self.chat.turn(body, timeout_s)


async def run_closed(
    chat: ChatClient, workload: Workload, concurrency: int, options: AgenticOptions
) -> dict[str, Any]:
    """Every session through `chat`, `concurrency` at once; returns the summary."""
    pending = list(reversed(workload.sessions))
    outcome = Outcome()

    async def slot() -> None:
        while pending:
            await _session(chat, workload, pending.pop(), options, outcome)

    work = [slot() for _ in range(concurrency)]
    summary = await _measured(chat, workload, outcome, options, work)
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

    summary = await _measured(chat, workload, outcome, options, [arrivals()])
    return {"session_rate": rate, **summary}


async def _measured(
    chat: ChatClient,
    workload: Workload,
    outcome: Outcome,
    options: AgenticOptions,
    work: list[Coroutine[Any, Any, None]],
) -> dict[str, Any]:
    """Run `work` (and the workload's long prompt) to its end; the summary of `outcome`, with
    what the engine counted meanwhile (where `chat` reads its stats)."""
    before = None if chat.bus is None else await server_stats(chat.bus)
    begin = time.perf_counter()
    if workload.long_prompt is not None:
        work = [*work, _long_prompt(chat, workload, options, outcome, begin)]
    await asyncio.gather(*work)
    summary = summarize(outcome, time.perf_counter() - begin, options.slo, options.report)
    after = None if chat.bus is None else await server_stats(chat.bus)
    if before is not None and after is not None and before["engine_id"] == after["engine_id"]:
        summary["server"] = server_moved(before, after)
    return summary


@dataclass
class _Streamed:
    """One request's streamed answer, in perf_counter seconds."""

    sent: float
    arrived: list[float] = field(default_factory=list)  # each chunk
    shown: list[int] = field(default_factory=list)  # the reply's tokens shown with each chunk
    text: list[str] = field(default_factory=list)
    reply: dict[str, Any] = field(default_factory=dict)  # the last message
    done: float = 0.0

    @property
    def error(self) -> str | None:
        if "error" in self.reply or "usage" not in self.reply:
            return str(self.reply.get("error", {}).get("code", "no_reply"))
        return None


async def _stream(chat: ChatClient, body: dict[str, Any], timeout_s: float) -> _Streamed:
    streamed = _Streamed(time.perf_counter())
    async with aclosing(chat.turn(body, timeout_s)) as answer:
        async for reply in answer:
            streamed.reply = reply
            if "delta" not in reply:
                break
            streamed.arrived.append(time.perf_counter())
            streamed.shown.append(reply.get("completion_tokens", 0))
            streamed.text.append(reply["delta"])
    streamed.done = time.perf_counter()
    return streamed


def _salted(options: AgenticOptions) -> dict[str, Any]:
    return {} if options.cache_salt is None else {"cache_salt": options.cache_salt}


async def _session(
    chat: ChatClient,
    workload: Workload,
    session: Session,
    options: AgenticOptions,
    outcome: Outcome,
) -> None:
    replies: list[str] = []
    conversation_id = None
    previous: TurnResult | None = None
    begin = time.perf_counter()
    outcome.started += 1
    for index, turn in enumerate(session.turns):
        body: dict[str, Any] = {
            "max_tokens": turn.max_tokens,
            "ignore_eos": options.ignore_eos,
            "stream": True,
        } | _salted(options)
        if conversation_id is None or options.history is History.RESENT:
            sent = replies if options.replies is Replies.GENERATED else session.recorded(index)
            body["messages"] = session.messages(workload.system, sent)
        else:
            body |= {"conversation_id": conversation_id, "message": turn.text}
        streamed = await _stream(chat, body, options.timeout_s)
        if streamed.error is not None:
            outcome.errors[streamed.error] += 1
            return  # the session cannot go on without this turn
        conversation_id = streamed.reply["conversation_id"]
        replies.append("".join(streamed.text))
        previous = _turn_result(session.id, index, streamed, previous, options.replies)
        outcome.turns.append(previous)
        if options.on_turn is not None:
            options.on_turn()
        if turn.tool_time_s:
            await asyncio.sleep(turn.tool_time_s)
    outcome.completed.add(session.id)
    outcome.session_s.append(time.perf_counter() - begin)


def _turn_result(
    session: str, index: int, streamed: _Streamed, previous: TurnResult | None, replies: Replies
) -> TurnResult:
    usage = streamed.reply["usage"]
    allowed = None
    if previous is not None:  # its prompt, and its reply where the server's own is sent back
        allowed = previous.prompt_tokens
        if replies is Replies.GENERATED:
            allowed += previous.completion_tokens
    first = streamed.arrived[0] if streamed.arrived else streamed.done
    return TurnResult(
        session,
        index,
        first - streamed.sent,
        streamed.done - streamed.sent,
        tuple(streamed.arrived),
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["prompt_sources"],
        allowed,
        tuple(streamed.shown),
    )


async def _long_prompt(
    chat: ChatClient, workload: Workload, options: AgenticOptions, outcome: Outcome, begin: float
) -> None:
    """The workload's long prompt, alone in a conversation of one turn, `at_s` into the run."""
    assert workload.config.long_prompt is not None and workload.long_prompt is not None
    await asyncio.sleep(max(0.0, begin + workload.config.long_prompt.at_s - time.perf_counter()))
    body = {
        "messages": [{"role": "user", "content": workload.long_prompt}],
        "max_tokens": LONG_PROMPT_MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "final": True,
    } | _salted(options)
    streamed = await _stream(chat, body, options.timeout_s)
    outcome.long_prompt = LongPromptResult(
        streamed.sent - begin,
        streamed.sent,
        streamed.arrived[0] if streamed.arrived else None,
        streamed.done,
        streamed.reply.get("usage", {}).get("prompt_tokens"),
        streamed.error,
    )
