"""What one actor asks of another over the bus: a render or a detokenize of one of the engine's
tokenizer replicas (`actors/tokenizer/`), a recompute plan of its planner (`actors/planner/`).

The callers' half of those subjects: the subject names, the message each carries, how long a
caller waits and what it does when nobody answers. A caller needs none of the answering actor's
code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import orjson
from opentelemetry import propagate

from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.messages import (
    ChatMessage,
    DetokenizeReply,
    DetokenizeRequest,
    MessageError,
    RecomputePlan,
    RecomputePlanRequest,
    RenderReply,
    RenderRequest,
    decode,
    encode,
)
from pensieve.actors.wire.schemas import ERROR_CODES, ApiError

logger = logging.getLogger(__name__)

TOKENIZER = "tokenizer"  # the tokenizer actor's name: its subjects and its queue group
RECOMPUTE_PLANNER = "recompute-planner"
RENDER = "render"
DETOKENIZE = "detokenize"
RENDER_TIMEOUT_S = 30.0  # what the ingress gives one render, retries included
# a request left unanswered this many times is given up: each waits a share of the time left
MAX_SILENT_TRIES = 3
_FIRST_PAUSE_S = 0.05  # after "no responders": doubled each time, at most _MAX_PAUSE_S
_MAX_PAUSE_S = 1.0
PLAN = "plan"
PLAN_TIMEOUT_S = 0.5  # what a caller gives one plan by default: it must never hold a turn up


async def render_remote(
    bus: Bus,
    engine_id: str,
    messages: Sequence[ChatMessage],
    timeout: float,
    max_tokens: int | None = None,
    prompt: str | None = None,
    tools: Sequence[dict[str, Any]] = (),
    prefill: str = "",
) -> list[int]:
    """The prompt token ids of `messages` (or of a raw `prompt`, encoded as it is, given with
    no messages), rendered by one of engine `engine_id`'s tokenizer replicas, in the caller's
    trace (resent as `_ask_replica` says). A template that refuses the messages:
    ApiError("invalid_request"); a prompt over `max_tokens`, or messages that one NATS message
    cannot carry to the tokenizer (a conversation's whole history goes each turn):
    ApiError("too_long")."""
    body = RenderRequest(tuple(messages), max_tokens, prompt, tuple(tools), prefill).encode()
    try:
        answer = await _ask_replica(bus, engine_id, RENDER, body, timeout)
    except ApiError as refused:
        if refused.code != "too_long":  # (raised here only by the bus, before sending)
            raise
        raise ApiError(
            "too_long",
            f"the turn's messages (a conversation's history with the new one) take {len(body)} "
            f"bytes, more than one NATS message carries to the tokenizer ({bus.max_payload} "
            "bytes, headers included): start a new conversation, or send fewer or shorter "
            "messages",
        ) from None
    try:
        return decode(answer, RenderReply).token_ids
    except MessageError as unreadable:  # an error body has no version: is it one?
        raise _refusal(answer) or ApiError(
            "internal", f"the tokenizer's answer could not be read: {unreadable}"
        ) from None


async def detokenize_remote(
    bus: Bus, engine_id: str, request: DetokenizeRequest, timeout: float
) -> DetokenizeReply:
    """The text of one step's reply tokens, found by one of engine `engine_id`'s tokenizer
    replicas (resent as `_ask_replica` says)."""
    answer = await _ask_replica(bus, engine_id, DETOKENIZE, request.encode(), timeout)
    try:
        reply = DetokenizeReply.decode(answer)
    except MessageError as unreadable:
        raise _refusal(answer) or ApiError(
            "internal", f"the tokenizer's answer could not be read: {unreadable}"
        ) from None
    if [u.key for u in reply.updates] != [p.key for p in request.pieces]:
        raise ApiError("internal", "the tokenizer answered other pieces than those asked")
    return reply


async def _ask_replica(bus: Bus, engine_id: str, verb: str, body: bytes, timeout: float) -> bytes:
    """The answer of one of the engine's tokenizer replicas to `body` on `verb`, in the
    caller's trace.

    A request nobody answers is sent again, to whichever replica NATS picks then: one that went
    unanswered (its replica died or hangs holding it) up to `MAX_SILENT_TRIES` times, one that
    found no replica subscribed (all restarting, or reconnecting to NATS) after a short pause.
    After `timeout` s in all: ApiError("unavailable")."""
    subject = subjects.internal(engine_id, TOKENIZER, verb)
    headers: dict[str, str] = {}
    propagate.inject(headers)  # W3C traceparent: the replica's span is the caller's child
    deadline = time.monotonic() + timeout
    num_silent, pause = 0, _FIRST_PAUSE_S
    while (left := deadline - time.monotonic()) > 0 and num_silent < MAX_SILENT_TRIES:
        try:
            return await _ask(bus, subject, body, left / (MAX_SILENT_TRIES - num_silent), headers)
        except TimeoutError:
            num_silent += 1
        except ConnectionError:
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, _MAX_PAUSE_S)
    raise ApiError(
        "unavailable",
        f"no tokenizer of engine {engine_id} answered {verb} in "
        f"{timeout:.0f} s; send the turn again",
    )


async def _ask(
    bus: Bus, subject: str, body: bytes, timeout: float, headers: dict[str, str]
) -> bytes:
    """One try: the first message of the answer (a render is answered in one)."""
    async with contextlib.aclosing(bus.ask(subject, body, timeout, headers)) as answer:
        return await anext(answer)


def _refusal(answer: bytes) -> ApiError | None:
    """The error a replica answered with, if `answer` is an error body."""
    with contextlib.suppress(orjson.JSONDecodeError):
        body = orjson.loads(answer)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("code") in ERROR_CODES:
            return ApiError(error["code"], str(error.get("message", "")))
    return None


async def plan_remote(
    bus: Bus,
    engine_id: str,
    conv_id: str,
    num_positions: int | None = None,
    timeout_s: float = PLAN_TIMEOUT_S,
) -> RecomputePlan | None:
    """Engine `engine_id`'s plan for the conversation's first `num_positions` positions (None:
    its whole stored log), in the caller's trace. None if no planner answers within `timeout_s`
    (none subscribed, or silence) or its answer is not a plan (an error, logged): the caller
    goes on without one, it never waits longer."""
    subject = subjects.internal(engine_id, RECOMPUTE_PLANNER, PLAN)
    body = encode(RecomputePlanRequest(conv_id, num_positions))
    headers: dict[str, str] = {}
    propagate.inject(headers)  # W3C traceparent: the planner's span is the caller's child
    try:
        async with contextlib.aclosing(bus.ask(subject, body, timeout_s, headers)) as answer:
            data = await anext(answer)
    except (TimeoutError, ConnectionError):
        return None
    try:
        return decode(data, RecomputePlan)
    except MessageError:
        logger.warning("the recompute planner of engine %s answered %r", engine_id, data[:200])
        return None
