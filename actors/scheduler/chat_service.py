"""The chat service's core: conversations, turns and replies around the engine (no I/O).

Everything here runs on one thread, the one that steps the engine (see `actor.py`): the
async shell hands it requests and receives replies through a `TurnSink`. A turn starts in two
calls: `reserve` claims its conversation and gives the messages, which the shell renders with the
chat template elsewhere, and `start` queues the rendered prompt. The scheduler reuses
the conversation's KV up to the first token where the prompt differs from its token log, so a
stateless client that resends its history (`messages`) hits the cache as well.

Finished turns are committed to the LMDB store by the store writer thread; the reply is sent once
the commit is durable.

A conversation lives until it is deleted: by the client, or by `expire` once it has been idle
past its TTL (`ExpiryConfig`). A final turn ends it: its KV goes at once, and it takes no more
turns.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.context import Context

from pensieve.actors.config import ExpiryConfig
from pensieve.actors.executor.model_runner import Launch
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.metrics import Metrics
from pensieve.actors.scheduler.request import FinishReason, Request, SamplingParams, common_prefix
from pensieve.actors.tokenizer.chat_tokenizer import ChatMessage, ChatTokenizer
from pensieve.actors.wire import tracing
from pensieve.actors.wire.messages import (
    DetokenizeReply,
    DetokenizeRequest,
    KvEvent,
    KvEventKind,
    TextPiece,
)
from pensieve.actors.wire.schemas import (
    MAX_PAGE,
    PAGE_BYTES,
    ApiError,
    ChatRequest,
    Page,
    chat_reply,
)
from pensieve.actors.wire.step import RequestTrace
from pensieve.actors.wire.step_codec import ExecutorLost
from pensieve.store import ConversationMeta, ConversationStore, StoreWriter, TurnRecord

logger = logging.getLogger(__name__)
FIRST_PAGE = Page(None, MAX_PAGE)


class TurnSink(Protocol):
    """Where a turn's output goes; called from the engine or store-writer thread."""

    def delta(self, text: str) -> None: ...
    def done(self, reply: dict[str, Any]) -> None: ...
    def error(self, error: ApiError) -> None: ...


@dataclass
class _Conversation:
    conv_id: str
    messages: list[ChatMessage]
    log: list[int]  # the token log as committed (prompt and reply of every finished turn)
    turns: int
    busy: bool = False
    stateless: bool = False  # made by a stateless request (see `ConversationMeta.stateless`)
    ended: bool = False  # a final turn ended it
    tenant: str | None = None  # only requests of this tenant reach it (None: the service's own)
    # its last finished turn's request span, which a trace of its KV leaving later links to
    last_span: trace.SpanContext = trace.INVALID_SPAN_CONTEXT


@dataclass(frozen=True)
class Reservation:
    """A turn that holds its conversation but has no prompt yet (see `ChatService.reserve`)."""

    request: ChatRequest
    conv: _Conversation
    messages: list[ChatMessage]  # to render
    new: bool  # a conversation this turn creates


@dataclass
class _Turn:
    conv: _Conversation
    request: Request
    messages: list[ChatMessage]  # this turn's chat, without the reply
    sink: TurnSink
    stream: bool
    stop: tuple[str, ...]
    started_at: float
    span: trace.Span
    followed: bool  # streamed or with stop strings: its text is found as its tokens come
    final: bool = False  # the conversation ends with this turn
    # when to end it early (time.monotonic()): its timeout, or at once once its requester
    # cancelled it (None: it runs to its end)
    cancel_at: float | None = None
    # its text, found by the tokenizer actor: the text so far, where the last answer left off
    # (`TextPiece`), how many output tokens were sent, whether a piece is out now
    text: str = ""
    prefix: int = 0
    read: int = 0
    fed: int = 0
    asking: bool = False
    sent: int = 0  # characters of text already streamed
    ended: bool = False  # the engine is done with it: its final text is being found
    whole: str | None = None  # the reply's final text
    holdback: int = field(init=False)

    def __post_init__(self) -> None:  # a streamed delta never reveals a stop string's beginning
        self.holdback = max((len(s) for s in self.stop), default=1) - 1


def turn_record(
    turn: int, user_message: str, text: str, request: Request, started_at: float
) -> TurnRecord:
    """The durable record of a finished turn."""
    sources = request.sources
    return TurnRecord(
        turn=turn,
        user_message=user_message,
        assistant_text=text,
        prompt_tokens=len(request.prompt_ids),
        new_prompt_tokens=sources.new,
        output_token_ids=tuple(request.output_ids),
        finish_reason=request.finish_reason.value if request.finish_reason else "abort",
        cached_gpu=sources.gpu,
        cached_cpu=sources.cpu,
        cached_recomputed=sources.recomputed,
        started_at=started_at,
        finished_at=max(time.time(), started_at),
    )


def commit_turn(
    store: ConversationStore,
    writer: StoreWriter,
    conv_id: str,
    record: TurnRecord,
    old_log: list[int],
    new_log: list[int],
    stateless: bool = False,
    final: bool = False,
    tenant: str | None = None,
) -> Future[Any]:
    """Hand the turn to the writer thread: the log keeps its common prefix with the new one."""
    keep = common_prefix(old_log, new_log)
    return writer.submit(
        store.commit_turn, conv_id, record, keep, new_log[keep:], stateless, final, tenant
    )


class ChatService:
    def __init__(
        self,
        engine: Engine,
        chat: ChatTokenizer,
        max_context: int,
        store: ConversationStore,
        writer: StoreWriter,
        max_waiting: int = 1024,
        new_id: Callable[[], str] = lambda: f"c-{uuid.uuid4().hex[:16]}",
        publish_kv: Callable[[list[KvEvent]], None] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.max_context = max_context
        self.store = store
        self.writer = writer
        self.max_waiting = max_waiting
        self.new_id = new_id
        self.conversations: dict[str, _Conversation] = {}
        self.turns: dict[str, _Turn] = {}  # request id -> turn in flight
        self._timed: dict[str, _Turn] = {}  # those of them with a `cancel_at`
        self.num_reserved = 0  # turns reserved and not yet started: queued from their arrival
        self.num_abandoned = 0  # turns cancelled because their requester went away
        self._deleting: set[str] = set()  # deleted here, not yet in the store
        self._closed: ApiError | None = None  # set by `close`: every new turn gets it
        # the KV event plane: after each step every event goes to `publish_kv` (on this thread;
        # the NATS shell sets it), where the swap manager keeps the CPU tier's spill index
        self.publish_kv = publish_kv
        # Prometheus metrics: each turn counted as its reply goes out (see `metrics.py`)
        self.metrics = metrics or Metrics()
        # the executor traces each turn's phases in its trace, which it learns from here
        self.engine.trace_requests(self._trace_context)
        # reply tokens go to the tokenizer actor for their text (the NATS shell sets this, and
        # hands each answer to `apply_text`); by default the same core answers on this thread
        self.detokenize: Callable[[DetokenizeRequest], None] = self._detokenize_here
        self._answers: list[DetokenizeReply] = []  # answered here, not applied yet
        self._applying = False
        self._followed: dict[str, _Turn] = {}  # request id -> a followed turn still running
        # followed turns with new tokens, whose text is found here during the engine's next
        # wait for the device rather than between two steps, where it would delay the next one
        self._due: list[_Turn] = []
        # and while it waits, the tokenizer's answers (the NATS shell sets this: it applies
        # them as they come, so a reply's text never waits for the step after the one in flight)
        self.take_text: Callable[[Launch], None] | None = None
        self.engine.while_waiting = self._while_waiting
        self.engine.take_kv_events()  # recording starts now, while the cache is empty

    # ---- requests ------------------------------------------------------------------------

    def reserve(self, request: ChatRequest, tenant: str | None = None) -> Reservation:
        """Claim the turn's conversation (no other turn may start on it) and give the messages
        to render; raises ApiError if the turn cannot be taken. A request of `tenant` reaches
        only that tenant's conversations: another's is not_found, as one that does not exist."""
        if self._closed is not None:
            raise self._closed
        if self.engine.num_waiting + self.num_reserved >= self.max_waiting:
            raise ApiError("overloaded", f"{self.max_waiting} turns are waiting already; retry")
        new = request.conversation_id is None
        if new:
            stateless = request.messages is not None or request.prompt is not None
            conv = _Conversation(self.new_id(), [], [], 0, stateless=stateless, tenant=tenant)
        else:
            conv = self._conversation(request.conversation_id or "", tenant)
            if conv.busy:
                raise ApiError(
                    "invalid_request",
                    f"conversation {conv.conv_id!r} has a turn "
                    "in progress; send the next message after its reply",
                )
            if conv.ended:
                raise _ended(conv.conv_id)
        if request.messages is not None:
            messages = list(request.messages)
        elif request.prompt is not None:  # stored as the turn's message: the text, if given
            text = request.prompt if isinstance(request.prompt, str) else ""
            messages = [{"role": "user", "content": text}]
        else:
            messages = [*conv.messages, {"role": "user", "content": request.message or ""}]
        conv.busy = True
        self.conversations[conv.conv_id] = conv
        self.num_reserved += 1
        return Reservation(request, conv, messages, new)

    def release(self, reservation: Reservation) -> None:
        """The reserved turn will not start: free its conversation again."""
        self.num_reserved -= 1
        self._free(reservation)

    def _free(self, reservation: Reservation) -> None:
        reservation.conv.busy = False
        if reservation.new:
            self.conversations.pop(reservation.conv.conv_id, None)

    def start(
        self,
        reservation: Reservation,
        prompt: list[int],
        sink: TurnSink,
        span: trace.Span = trace.INVALID_SPAN,
        planned_recompute: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        """Queue the reserved turn with its rendered prompt (and the recompute planner's ranges
        for its history, if it has them); its phases are recorded under `span` (the request's
        span; a no-op by default). On ApiError the reservation is freed."""
        request, conv = reservation.request, reservation.conv
        self.num_reserved -= 1  # from here the turn is the engine's, or refused
        if self._closed is not None:
            self._free(reservation)
            raise self._closed
        ids = request.prompt if isinstance(request.prompt, tuple) else ()  # given by the client
        if ids and max(ids) >= self.chat.vocab_size:
            self._free(reservation)
            raise ApiError(
                "invalid_request",
                "'prompt' holds token ids outside the model's "
                f"vocabulary (0 to {self.chat.vocab_size - 1})",
            )
        room = self.max_context - len(prompt)
        if room < 1:
            self._free(reservation)
            raise ApiError(
                "too_long",
                f"the prompt has {len(prompt)} tokens; the model's "
                f"context holds {self.max_context}",
            )
        seed = request.seed
        if seed is None and request.temperature > 0:
            seed = zlib.crc32(f"{conv.conv_id}:{conv.turns}:{time.time_ns()}".encode())
        sampling = SamplingParams(
            max_tokens=min(request.max_tokens, room),
            temperature=request.temperature,
            top_p=request.top_p,
            seed=seed,
            ignore_eos=request.ignore_eos,
        )
        try:
            engine_request = self.engine.add_request(
                conv.conv_id, prompt, sampling, planned_recompute
            )
        except ValueError as error:
            self._free(reservation)
            raise ApiError("invalid_request", str(error)) from None
        followed = request.stream or bool(request.stop)
        turn = _Turn(
            conv,
            engine_request,
            reservation.messages,
            sink,
            request.stream,
            request.stop,
            time.time(),
            span,
            followed,
            final=request.final,
            cancel_at=None if request.timeout_s is None else time.monotonic() + request.timeout_s,
        )
        self.turns[engine_request.request_id] = turn
        if followed:
            self._followed[engine_request.request_id] = turn
        if request.timeout_s is not None:
            self._timed[engine_request.request_id] = self.turns[engine_request.request_id]
        span.set_attributes(
            {
                "pensieve.conversation_id": conv.conv_id,
                "pensieve.turn": conv.turns,
                "pensieve.prompt_tokens": len(prompt),
                **genai_request(conv.conv_id, request, sampling),
                "gen_ai.usage.input_tokens": len(prompt),
            }
        )

    def get(
        self, conv_id: str, page: Page = FIRST_PAGE, tenant: str | None = None
    ) -> dict[str, Any]:
        """The conversation's turns from turn `page.cursor` on, as many as fit in one answer
        (`page.limit`, and PAGE_BYTES of text); `next_cursor` continues, None at the end.
        Reads only the store and single values, so any thread may call it (as may `list`)."""
        meta = None if conv_id in self._deleting else self.store.meta(conv_id)
        if meta is None or meta.tenant != tenant:
            raise _not_found(conv_id)
        records = self.store.turns(conv_id)
        first = int(page.cursor or 0)
        turns: list[dict[str, Any]] = []
        size = 0
        for r in records[first : first + page.limit]:
            size += len(r.user_message.encode()) + len(r.assistant_text.encode()) + 200
            if turns and size > PAGE_BYTES:
                break
            turns.append(
                {
                    "turn": r.turn,
                    "message": r.user_message,
                    "text": r.assistant_text,
                    "finish_reason": r.finish_reason,
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": len(r.output_token_ids),
                }
            )
        following = first + len(turns)
        conv = self.conversations.get(conv_id)
        busy = conv is not None and conv.busy
        num_tokens = len(self.store.token_log(conv_id))
        return {
            "conversation_id": conv_id,
            "turns": turns,
            "num_tokens": num_tokens,
            "num_turns": len(records),
            "busy": busy,
            "ended": meta.ended,
            "next_cursor": str(following) if following < len(records) else None,
        }

    def delete(self, conv_id: str, tenant: str | None = None) -> Future[Any]:
        """Forget the conversation everywhere; the future resolves once the store forgot it."""
        conv = self.conversations.get(conv_id)
        meta = self.store.meta(conv_id) if conv is None else None
        owner = conv.tenant if conv is not None else meta.tenant if meta is not None else None
        if (conv is None and meta is None) or owner != tenant:
            raise _not_found(conv_id)
        if conv is not None and conv.busy:
            raise ApiError("invalid_request", f"conversation {conv_id!r} has a turn in progress")
        self.conversations.pop(conv_id, None)
        self.engine.forget(conv_id)
        self._pass_kv_events()
        # until the writer has deleted it, the store still holds it: no turn may load it again
        self._deleting.add(conv_id)
        deleted = self.writer.submit(self.store.delete, conv_id)
        deleted.add_done_callback(lambda _: self._deleting.discard(conv_id))
        return deleted

    def expired(self, expiry: ExpiryConfig, now: float, limit: int) -> list[str]:
        """Up to `limit` conversations idle past their TTL at `now`, as the store has them.
        Reads only the store, so any thread may call it; `expire` then deletes them."""
        return self.store.select(lambda meta: _is_expired(meta, expiry, now), limit)

    def expire(
        self, conv_ids: Sequence[str], expiry: ExpiryConfig, now: float
    ) -> list[Future[Any]]:
        """Delete those of `conv_ids` still idle past their TTL at `now`, as `delete` does; a
        turn that started or finished since `expired` listed them keeps its conversation.
        Returns the deletes' futures."""
        deleted: list[Future[Any]] = []
        for conv_id in conv_ids:
            conv = self.conversations.get(conv_id)
            if conv_id in self._deleting or (conv is not None and conv.busy):
                continue
            meta = self.store.meta(conv_id)  # not busy: no commit of it is pending
            if meta is not None and _is_expired(meta, expiry, now):
                deleted.append(self.delete(conv_id, meta.tenant))
        return deleted

    def list(self, page: Page = FIRST_PAGE, tenant: str | None = None) -> dict[str, Any]:
        """`tenant`'s conversation ids in the store's order, `page.limit` at most after
        `page.cursor`; `next_cursor` continues, None at the end."""
        after = bytes.fromhex(page.cursor) if page.cursor else None
        ids, last = self.store.list_page(after, page.limit, tenant)
        return {"conversations": ids, "next_cursor": last.hex() if last else None}

    def stats(self) -> dict[str, Any]:
        """The engine's totals and state (`Engine.stats`) with the turns this service has in
        flight (handed to the engine and not yet answered), and how many turns it cancelled
        because their requester went away."""
        return {
            **self.engine.stats(),
            "turns_in_flight": len(self.turns),
            "turns_abandoned": self.num_abandoned,
        }

    # ---- the step loop -------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        outcome = self.engine.step()
        self._pass_kv_events()
        asked = []
        for request in outcome.finished:
            turn = self.turns.get(request.request_id)
            if turn is not None and self._end(turn):
                asked.append(turn)
        if self._followed:
            followed = self._followed
            grown = [followed[r] for r in outcome.new_tokens if r in followed]
            if self.detokenize != self._detokenize_here:  # a replica works on them meanwhile
                asked += grown
            else:  # a reply's first text at once: it is the time to first token
                for turn in grown:
                    (self._due if turn.fed else asked).append(turn)
        self._ask_text(asked)
        if self._due and not self.engine.has_work():  # no wait comes: now
            self._follow_due()
        if self._timed:  # turns with a timeout, or cancelled while suspended
            now = time.monotonic()
            for turn in [t for t in self._timed.values() if (t.cancel_at or 0.0) <= now]:
                self._end_early(turn)

    def cancel(self, conv_id: str, tenant: str | None = None) -> bool:
        """End the conversation's turn in flight now, as its requester asks: what it generated
        so far is its reply (committed as a turn with finish_reason "cancelled"; one that
        generated nothing is answered `cancelled` and leaves no turn), its KV kept as after a
        normal end. False if it has no turn in flight."""
        conv = self.conversations.get(conv_id)
        if conv is None or conv.tenant != tenant:
            meta = None if conv is not None else self.store.meta(conv_id)
            if meta is None or meta.tenant != tenant:
                raise _not_found(conv_id)
            return False  # stored, and idle
        turn = next((t for t in self.turns.values() if t.conv is conv), None)
        if turn is None:
            return False
        self._cancel(turn)
        return True

    def abandon(self, sink: TurnSink) -> bool:
        """The requester of the turn that answers to `sink` went away (its reply inbox is gone,
        or its connection closed): end the turn as `cancel` does, its KV kept as after a normal
        end. False if that turn is no longer in flight."""
        turn = next((t for t in self.turns.values() if t.sink is sink), None)
        if turn is None:
            return False
        if not turn.ended:
            logger.info(
                "turn %d of %s: its requester went away; cancelled",
                turn.conv.turns,
                turn.conv.conv_id,
            )
            self.num_abandoned += 1
        self._cancel(turn)
        return True

    def _cancel(self, turn: _Turn) -> None:
        if turn.ended:  # its text is being found; it ends with the tokens it has
            return
        turn.cancel_at = -math.inf
        self._timed[turn.request.request_id] = turn  # tried again each step until it ends
        self._end_early(turn)

    def _end_early(self, turn: _Turn) -> None:
        """End a turn whose time is up; one suspended now ends once it runs again."""
        if self.engine.cancel(turn.request) and self._end(turn):
            self._ask_text([turn])

    def recover(self, error: Exception) -> None:
        """The engine's step raised: answer every turn in flight with `internal` and reset the
        engine (`Engine.abort_all`); conversations keep their committed turns, and a turn sent again
        recomputes its history and gives the output it would have given."""
        message = f"engine step failed ({type(error).__name__}: {error}); nothing was stored"
        self.engine.abort_all(message)
        self._pass_kv_events()
        # a lost executor is the deployment's fault, not the turn's: worth sending again
        code = "unavailable" if isinstance(error, ExecutorLost) else "internal"
        self.fail_all(ApiError(code, f"{message}, send the turn again"))

    def close(self, error: ApiError) -> None:
        """Take no more turns, and answer every turn in flight with `error` (shutting down)."""
        self._closed = error
        self.fail_all(error)

    def fail_all(self, error: ApiError) -> None:
        """Answer every turn in flight with `error` (the engine cannot go on with them)."""
        for turn in self.turns.values():
            turn.conv.busy = False
            turn.sink.error(error)
        self.turns.clear()
        self._timed.clear()
        self._followed.clear()
        self._due.clear()

    def _pass_kv_events(self) -> None:
        """The chunk events since the last call, to the publisher."""
        events = self.engine.take_kv_events()
        if events:
            self.metrics.count_kv_events(events)
            if self.publish_kv is not None:
                self.publish_kv(events)
            if tracing.enabled():
                self._trace_kv_leaving(events)

    def _trace_kv_leaving(self, events: Sequence[KvEvent]) -> None:
        """Chunks of idle conversations swapped out or dropped, as spans linked to their last
        turn (a running turn's own suspensions are on its trace already)."""
        moved: dict[KvEventKind, Counter[str]] = {
            KvEventKind.SWAPPED_OUT: Counter(),
            KvEventKind.DROPPED: Counter(),
        }
        for event in events:
            counts = moved.get(event.kind)
            conv = self.conversations.get(event.conversation_id)
            if counts is not None and not (conv is not None and conv.busy):
                counts[event.conversation_id] += 1
        if moved[KvEventKind.SWAPPED_OUT] or moved[KvEventKind.DROPPED]:
            self.trace_evictions(
                dict(moved[KvEventKind.SWAPPED_OUT]), dict(moved[KvEventKind.DROPPED])
            )

    # ---- internals -----------------------------------------------------------------------

    def _conversation(self, conv_id: str, tenant: str | None) -> _Conversation:
        conv = self.conversations.get(conv_id)
        if conv is not None:
            if conv.tenant != tenant:
                raise _not_found(conv_id)
            return conv
        meta = None if conv_id in self._deleting else self.store.meta(conv_id)
        if meta is None or meta.tenant != tenant:
            raise _not_found(conv_id)
        if meta.ended:  # its KV is gone and stays gone
            raise _ended(conv_id)
        records = self.store.turns(conv_id)
        messages: list[ChatMessage] = []
        for record in records:
            messages.append({"role": "user", "content": record.user_message})
            messages.append({"role": "assistant", "content": record.assistant_text})
        log = self.store.token_log(conv_id)
        self.engine.restore(conv_id, log)
        return _Conversation(
            conv_id, messages, log, len(records), stateless=meta.stateless, tenant=meta.tenant
        )

    def _trace(self, turn: _Turn, record: TurnRecord) -> None:
        """The turn's outcome as attributes of its request span, and its wait for admission as
        the child span "queued". (The recompute planner traces its own "kv.plan_recompute"
        when the turn arrives, the executor "prefill" and "decode", and the swap manager
        "kv.swap_in", where they run: see `_trace_context`.)"""
        request, span = turn.request, turn.span
        span.set_attributes(
            {
                "pensieve.cached_tokens.gpu": record.cached_gpu,
                "pensieve.cached_tokens.cpu": record.cached_cpu,
                "pensieve.cached_tokens.recomputed": record.cached_recomputed,
                "pensieve.new_prompt_tokens": record.new_prompt_tokens,
                "pensieve.completion_tokens": len(request.output_ids),
                "pensieve.finish_reason": record.finish_reason,
                "pensieve.suspensions": request.num_suspensions,
                "pensieve.swapped_in_bytes": request.swapped_in_blocks * self.engine.block_bytes,
                "pensieve.swapped_out_bytes": request.swapped_out_blocks * self.engine.block_bytes,
                "gen_ai.usage.output_tokens": len(request.output_ids),
                "gen_ai.response.finish_reasons": (record.finish_reason,),
            }
        )
        turn.conv.last_span = span.get_span_context()
        if span.is_recording():
            self._trace_phases(request, record, trace.set_span_in_context(span))

    def _trace_phases(self, request: Request, record: TurnRecord, parent: Context) -> None:
        offset = time.time_ns() - int(self.engine.clock() * 1e9)  # engine clock -> epoch ns
        admitted = request.admitted_at or request.arrival
        queued = tracing.tracer("scheduler").start_span(
            "queued", parent, start_time=offset + int(request.arrival * 1e9)
        )
        queued.end(end_time=offset + int(admitted * 1e9))

    def _trace_context(self, request_id: str) -> RequestTrace | None:
        """The trace of a turn's request, for the executor that runs it: its span's context and
        the blocks swapped in for it (None: it is not traced)."""
        turn = self.turns.get(request_id)
        if turn is None or not turn.span.is_recording():
            return None
        return tracing.traceparent(turn.span), turn.request.swapped_in_blocks

    def trace_evictions(
        self, conv_ids_swapped_out: dict[str, int], conv_ids_dropped: dict[str, int]
    ) -> None:
        """Trace chunks of idle conversations leaving the GPU for the CPU tier
        (`conv_ids_swapped_out`) or leaving the cache (`conv_ids_dropped`), each a conversation
        id -> its number of chunks: one span per conversation under the swap manager, in a trace
        of its own linked to the conversation's last turn (no link if it has none here)."""
        manager = tracing.tracer("swap-manager")
        for name, chunks in (("kv.swap_out", conv_ids_swapped_out), ("kv.drop", conv_ids_dropped)):
            for conv_id, num_chunks in chunks.items():
                conv = self.conversations.get(conv_id)
                last = conv.last_span if conv is not None else trace.INVALID_SPAN_CONTEXT
                links = [trace.Link(last)] if last.is_valid else []
                attributes = {"pensieve.conversation_id": conv_id, "pensieve.chunks": num_chunks}
                manager.start_span(name, Context(), links=links, attributes=attributes).end()

    # ---- the reply's text, from the tokenizer actor ---------------------------------------

    def apply_text(self, reply: DetokenizeReply) -> None:
        """The tokenizer's answer to pieces of replies (`detokenize`): stream what is safe to
        show, end a turn where a stop string completes (`Engine.stop_at`: the tokens sampled
        after it are discarded, so the reply never depends on how late the answer came), and
        answer a turn whose final text has come."""
        asked = []
        for update in reply.updates:
            turn = self.turns.get(update.key)
            if turn is None:  # answered meanwhile (failed, or the service closed)
                continue
            turn.asking = False
            turn.text = turn.text[: len(turn.text) - update.trim] + update.text
            turn.prefix, turn.read = update.prefix, update.read
            if update.stop_at is not None:
                self._followed.pop(update.key, None)  # nothing after the stop is followed
                if self.engine.stop_at(turn.request, update.stop_at) and not turn.ended:
                    self._end(turn)
            if update.whole is not None:
                turn.whole = update.whole
                self._complete(turn)
                continue
            if turn.stream and turn.request.stop_at is None:
                end = len(turn.text) - turn.holdback
                if end > turn.sent:
                    turn.sink.delta(turn.text[turn.sent : end])
                    turn.sent = end
            asked.append(turn)
        self._ask_text(asked)

    def text_failed(self, request: DetokenizeRequest, error: ApiError) -> None:
        """No tokenizer answered `request`: its turns end with `error`, their conversations as
        before them (the engine stops those still running)."""
        for piece in request.pieces:
            turn = self.turns.pop(piece.key, None)
            if turn is None:
                continue
            self._followed.pop(piece.key, None)
            self._timed.pop(piece.key, None)
            if not turn.ended:
                self.engine.cancel(turn.request)
            turn.conv.busy = False
            turn.sink.error(error)

    def _while_waiting(self, step: Launch) -> None:
        self._follow_due()
        if self.take_text is not None and self._text_out():
            self.take_text(step)

    def _text_out(self) -> bool:
        return any(turn.asking for turn in self.turns.values())

    def _follow_due(self) -> None:
        due, self._due = self._due, []
        if due:
            self._ask_text(due)

    def _detokenize_here(self, request: DetokenizeRequest) -> None:
        """Without a tokenizer actor (the service driven directly): the same core, here."""
        self._answers.append(DetokenizeReply(tuple(map(self.chat.follow, request.pieces))))

    def _ask_text(self, turns: Sequence[_Turn]) -> None:
        """Send the tokenizer what `turns` have new: tokens of a followed turn, or the whole
        reply of one that ended. A turn has at most one piece out, so answers apply in order."""
        pieces = [piece for turn in turns if (piece := self._piece(turn)) is not None]
        if pieces:
            self.detokenize(DetokenizeRequest(tuple(pieces)))
        if self._applying:  # answered here: the outermost call applies them, in order
            return
        self._applying = True
        try:
            while self._answers:
                self.apply_text(self._answers.pop(0))
        finally:
            self._applying = False

    def _piece(self, turn: _Turn) -> TextPiece | None:
        if turn.asking or turn.whole is not None:
            return None
        output = turn.request.output_ids
        tail = turn.text[len(turn.text) - turn.holdback :] if turn.holdback else ""
        key = turn.request.request_id
        if turn.ended:
            prefix, read = (turn.prefix, turn.read) if turn.followed else (len(output),) * 2
            piece = TextPiece(
                key,
                tuple(output),
                0,
                prefix,
                read,
                tail,
                turn.stop,
                True,
                tracing.traceparent(turn.span),
            )
        elif turn.request.stop_at is None and len(output) > turn.fed:
            piece = TextPiece(
                key,
                tuple(output[turn.prefix :]),
                turn.prefix,
                turn.prefix,
                turn.read,
                tail,
                turn.stop,
            )
        else:
            return None
        turn.fed, turn.asking = len(output), True
        return piece

    def _end(self, turn: _Turn) -> bool:
        """The engine is done with `turn`. True if its final text is to be found; a turn that
        failed, or was cancelled before its first token, is answered at once."""
        key = turn.request.request_id
        turn.ended = True
        self._followed.pop(key, None)
        self._timed.pop(key, None)
        request = turn.request
        cancelled = request.finish_reason is FinishReason.CANCELLED
        if request.finish_reason is FinishReason.ABORT or (cancelled and not request.output_ids):
            self._complete(turn)
            return False
        return True

    def _complete(self, turn: _Turn) -> None:
        request, conv = turn.request, turn.conv
        del self.turns[request.request_id]
        if request.finish_reason is FinishReason.ABORT:
            conv.busy = False
            code = "too_long" if (request.error or "").startswith("too_long") else "internal"
            turn.sink.error(ApiError(code, request.error or "the turn was aborted"))
            return
        if request.finish_reason is FinishReason.CANCELLED and not request.output_ids:
            conv.busy = False
            if conv.turns == 0:  # a conversation this turn would have made: none is left
                self.conversations.pop(conv.conv_id, None)
                self.engine.forget(conv.conv_id)
                self._pass_kv_events()
            turn.sink.error(
                ApiError(
                    "cancelled", "the turn was cancelled before its first token; nothing was stored"
                )
            )
            return
        assert turn.whole is not None
        text = turn.whole
        if turn.stream:
            streamed = turn.text[: turn.sent]
            if not text.startswith(streamed):  # the tokenizer decodes a whole reply differently
                logger.warning(
                    "turn %s of %s: the reply's text does not continue its streamed deltas",
                    conv.turns,
                    conv.conv_id,
                )
            elif len(text) > turn.sent:
                turn.sink.delta(text[turn.sent :])
        user = turn.messages[-1]["content"]
        record = turn_record(conv.turns, user, text, request, turn.started_at)
        self._trace(turn, record)
        log = request.all_ids
        future = commit_turn(
            self.store,
            self.writer,
            conv.conv_id,
            record,
            conv.log,
            log,
            conv.stateless,
            turn.final,
            conv.tenant,
        )
        if turn.final:  # its KV is of no use any more; if the commit fails, the next turn
            self.engine.forget(conv.conv_id)  # recomputes it from the stored log
            self._pass_kv_events()
        cached = {
            "gpu": record.cached_gpu,
            "cpu": record.cached_cpu,
            "recomputed": record.cached_recomputed,
        }
        reply = chat_reply(
            conv.conv_id,
            record.turn,
            text,
            list(request.output_ids),
            record.finish_reason,
            record.prompt_tokens,
            cached,
            turn.final,
        )

        # On the store writer's thread, once the commit settles. The conversation stays busy
        # until then and moves on only with the store: a failed commit leaves it as it was
        # before the turn (its next turn recomputes from the divergence), and a delete cannot
        # slip in between. `busy` is cleared last, so the engine thread, which reads it first,
        # never sees half an update.
        def answer(done: Future[Any]) -> None:
            error = done.exception()
            if error is None:
                conv.log = log
                conv.messages = [*turn.messages, {"role": "assistant", "content": text}]
                conv.turns += 1
                conv.ended = turn.final
                conv.busy = False
                self.metrics.observe_turn(request)  # before the reply: a scrape after it sees it
                turn.sink.done(reply)
                _log_turn(conv.conv_id, record, request)
            else:
                conv.busy = False
                logger.error("turn %s of %s not stored: %s", record.turn, conv.conv_id, error)
                turn.sink.error(
                    ApiError(
                        "internal",
                        f"the turn could not be stored ({error}); the conversation is as before it",
                    )
                )

        future.add_done_callback(answer)


def _not_found(conv_id: str) -> ApiError:
    """Also the answer for another tenant's conversation: its existence is not revealed."""
    return ApiError("not_found", f"no conversation {conv_id!r}")


def _ended(conv_id: str) -> ApiError:
    return ApiError(
        "invalid_request",
        f"conversation {conv_id!r} has ended (a final turn); "
        "it can be read until it expires, and takes no more turns",
    )


def _is_expired(meta: ConversationMeta, expiry: ExpiryConfig, now: float) -> bool:
    return now - meta.last_active > expiry.ttl_s(meta.stateless or meta.ended)


def genai_request(conv_id: str, request: ChatRequest, sampling: SamplingParams) -> dict[str, Any]:
    """The OpenTelemetry GenAI semantic-convention attributes of a chat request."""
    attributes = {
        "gen_ai.operation.name": "chat" if request.prompt is None else "text_completion",
        "gen_ai.provider.name": "pensieve",
        "gen_ai.system": "pensieve",  # the older name of gen_ai.provider.name
        "gen_ai.conversation.id": conv_id,
        "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_p": request.top_p,
    }
    if sampling.seed is not None:  # the one sampled with, also when the service chose it
        attributes["gen_ai.request.seed"] = sampling.seed
    return attributes


def _log_turn(conv_id: str, record: TurnRecord, request: Request) -> None:
    """One line per finished turn: where its prompt came from, what it produced, how fast."""
    if not logger.isEnabledFor(logging.INFO):
        return
    first = request.first_token_time or request.arrival
    finish = request.finish_time or first
    logger.info(
        "turn %d of %s: %d prompt tokens (gpu %d, cpu %d, recomputed %d, new %d), %d completion "
        "tokens, %s; first token %.3f s, done %.3f s",
        record.turn,
        conv_id,
        record.prompt_tokens,
        record.cached_gpu,
        record.cached_cpu,
        record.cached_recomputed,
        record.new_prompt_tokens,
        len(record.output_token_ids),
        record.finish_reason,
        first - request.arrival,
        finish - request.arrival,
    )
