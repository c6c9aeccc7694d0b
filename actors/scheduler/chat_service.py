"""The chat service's core: turns around the engine (no I/O).

Everything here runs on one thread, the one that steps the engine (see `actor.py`): the
async shell hands it requests and receives replies through a `TurnSink`. A turn starts in two
calls: `reserve` claims its conversation and gives the messages, which the shell renders with the
chat template elsewhere, and `start` queues the rendered prompt. The scheduler reuses
the conversation's KV up to the first token where the prompt differs from its token log, so a
stateless client that resends its history (`messages`) hits the cache as well.

`ChatService` coordinates its parts: the conversations (`conversations.py`: lookup, deletion,
expiry), the reply text (`reply_text.py`: incremental text and stop strings), the store commit
of a finished turn (`turn_commit.py`: its reply is sent once the commit is durable) and the
turn's spans (`turn_tracing.py`). A final turn ends its conversation: its KV goes at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from opentelemetry import trace

from pensieve.actors.config import ExpiryConfig
from pensieve.actors.scheduler.conversations import (
    FIRST_PAGE,
    Conversation,
    Conversations,
    Reservation,
    history_of,
)
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.metrics import Metrics
from pensieve.actors.scheduler.replication import Replicate
from pensieve.actors.scheduler.reply_text import ReplyText
from pensieve.actors.scheduler.request import FinishReason
from pensieve.actors.scheduler.step_log import StepLog
from pensieve.actors.scheduler.turn import Turn, TurnSink, sampling_of
from pensieve.actors.scheduler.turn_commit import TurnCommitter, last_sent, turn_record
from pensieve.actors.scheduler.turn_tracing import TurnTracer
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire import tracing
from pensieve.actors.wire.messages import (
    ChatMessage,
    DetokenizeReply,
    DetokenizeRequest,
    KvEvent,
)
from pensieve.actors.wire.replies import ConversationReply, ListReply
from pensieve.actors.wire.schemas import ApiError, ChatRequest, Page
from pensieve.actors.wire.step import Launch
from pensieve.actors.wire.step_codec import ExecutorLost
from pensieve.actors.wire.structured import Grammar, tool_call_grammar
from pensieve.store import ConversationStore, StoreWriter

logger = logging.getLogger(__name__)


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
        model: str = "",
    ) -> None:
        """`model`: the name the engine's model is served under, for the turns' spans."""
        self.engine = engine
        self.chat = chat
        self.max_context = max_context
        self.store = store
        self.writer = writer
        self.max_waiting = max_waiting
        self.turns: dict[str, Turn] = {}  # request id -> turn in flight
        self._timed: dict[str, Turn] = {}  # those of them with a `cancel_at`
        self.num_reserved = 0  # turns reserved and not yet started: queued from their arrival
        self.num_abandoned = 0  # turns cancelled because their requester went away
        self._closed: ApiError | None = None  # set by `close`: every new turn gets it
        # the KV event plane: after each step every event goes to `publish_kv` (on this thread;
        # the NATS shell sets it), where the swap manager keeps the CPU tier's spill index
        self.publish_kv = publish_kv
        # before the first reply of turns that ended: a load report without them (set by the
        # NATS shell), so that a next turn sent as the reply comes is placed by such a load
        self.publish_load: Callable[[], None] | None = None
        self._turns_ended = False  # since the last report `publish_load` sent
        # Prometheus metrics: each turn counted as its reply goes out (see `metrics.py`)
        self.metrics = metrics or Metrics(model)
        self.convs = Conversations(store, writer, new_id, engine.restore, self._forget_kv)
        self.text = ReplyText(chat, self.turns, self._stop_at, self._complete)
        self.commits = TurnCommitter(store, writer, self.metrics)
        self.tracer = TurnTracer(self.turns, self.convs.by_id, engine, model)
        self.step_log = StepLog()  # the engine thread's slowest step intervals
        # the executor traces each turn's phases and copies in its trace, learnt from here
        self.engine.trace_requests(self.tracer.context, self.tracer.copy_contexts)
        self.engine.while_waiting = self.text.while_waiting
        self.engine.take_kv_events()  # recording starts now, while the cache is empty

    @property
    def conversations(self) -> dict[str, Conversation]:
        """The conversations in memory, by id."""
        return self.convs.by_id

    @property
    def detokenize(self) -> Callable[[DetokenizeRequest], None]:
        """Where reply tokens go for their text: the tokenizer actor (the NATS shell sets this,
        and hands each answer to `apply_text`); by default the same core, on this thread."""
        return self.text.detokenize

    @detokenize.setter
    def detokenize(self, send: Callable[[DetokenizeRequest], None]) -> None:
        self.text.detokenize = send

    @property
    def take_text(self) -> Callable[[Launch], None] | None:
        """What takes the tokenizer's answers while the engine waits for the device."""
        return self.text.take_text

    @take_text.setter
    def take_text(self, take: Callable[[Launch], None] | None) -> None:
        self.text.take_text = take

    # ---- requests ------------------------------------------------------------------------

    def reserve(self, request: ChatRequest, tenant: str | None = None) -> Reservation:
        """Claim the turn's conversation (no other turn may start on it) and give the messages
        to render; raises ApiError if the turn cannot be taken. A request of `tenant` reaches
        only that tenant's conversations: another's is not_found, as one that does not exist."""
        if self._closed is not None:
            raise self._closed
        if self.engine.num_waiting + self.num_reserved >= self.max_waiting:
            raise ApiError("overloaded", f"{self.max_waiting} turns are waiting already; retry")
        reservation = self.convs.claim(request, tenant)
        self.num_reserved += 1
        return reservation

    def release(self, reservation: Reservation) -> None:
        """The reserved turn will not start: free its conversation again."""
        self.num_reserved -= 1
        self.convs.free(reservation)

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
        try:
            if self._closed is not None:
                raise self._closed
            sampling = sampling_of(request, conv, prompt, self.max_context, self.chat.vocab_size)
            if request.forces_call:
                sampling = dataclasses.replace(sampling, grammar=self._call_grammar(request))
            engine_request = self.engine.add_request(
                conv.conv_id,
                prompt,
                sampling,
                planned_recompute,
                self.engine.namespace(conv.tenant, request.cache_salt),
            )
        except ApiError:
            self.convs.free(reservation)
            raise
        except ValueError as error:
            self.convs.free(reservation)
            raise ApiError("invalid_request", str(error)) from None
        stop = request.stop
        followed = request.stream or bool(stop)
        turn = Turn(
            conv,
            engine_request,
            reservation.messages,
            sink,
            request.stream,
            stop,
            time.time(),
            span,
            followed,
            final=request.final,
            cancel_at=None if request.timeout_s is None else time.monotonic() + request.timeout_s,
            tool_parser=None if request.tool_choice == "none" else self.chat.tool_parser,
            structure=request.structure,
        )
        self.turns[engine_request.request_id] = turn
        if followed:
            self.text.follow(turn)
        if request.timeout_s is not None:
            self._timed[engine_request.request_id] = turn
        self.tracer.started(span, conv, request, sampling, len(prompt))

    def _call_grammar(self, request: ChatRequest) -> Grammar:
        """A reply that is one call, in the tool call parser's format, of the function
        `tool_choice` names (or of any of `tools`, for "required")."""
        parser = self.chat.tool_parser
        names = tuple(t["function"]["name"] for t in request.tools)
        if request.tool_name is not None:
            names = (request.tool_name,)
        return tool_call_grammar(
            request.tools, names, parser.forced_prefix, parser.closer or "", parser.arguments_key
        )

    def get(
        self, conv_id: str, page: Page = FIRST_PAGE, tenant: str | None = None
    ) -> ConversationReply:
        """The conversation's turns, a page at a time (`Conversations.get`); any thread."""
        return self.convs.get(conv_id, page, tenant)

    def delete(self, conv_id: str, tenant: str | None = None) -> Future[Any]:
        """Forget the conversation everywhere; the future resolves once the store forgot it."""
        return self.convs.delete(conv_id, tenant)

    def drop(self, conv_id: str) -> bool:
        """Forget the conversation's copy in memory and its KV (`Conversations.drop`)."""
        return self.convs.drop(conv_id)

    def replicate_to(self, replicate: Replicate | None) -> None:
        """From now on every store write of a conversation goes to the replicated turn log
        first (`replication.py`); None: the store alone."""
        self.commits.replicate = replicate
        self.convs.replicate = replicate

    def create(
        self, messages: Sequence[ChatMessage], tenant: str | None = None
    ) -> tuple[str, Future[Any]]:
        """A new conversation with no turn yet (`Conversations.create`)."""
        return self.convs.create(messages, tenant, time.time())

    def expired(self, expiry: ExpiryConfig, now: float, limit: int) -> list[str]:
        """Up to `limit` conversations idle past their TTL at `now` (any thread may call it)."""
        return self.convs.expired(expiry, now, limit)

    def expire(
        self, conv_ids: Sequence[str], expiry: ExpiryConfig, now: float
    ) -> list[Future[Any]]:
        """Delete those of `conv_ids` still idle past their TTL (`Conversations.expire`)."""
        return self.convs.expire(conv_ids, expiry, now)

    def list(self, page: Page = FIRST_PAGE, tenant: str | None = None) -> ListReply:
        """`tenant`'s conversation ids, a page at a time (`Conversations.list`); any thread."""
        return self.convs.list(page, tenant)

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
        timing = self.engine.last_timing  # of the step applied (None: none was)
        if timing is not None and timing.decodes + timing.prefill_tokens:
            self.metrics.observe_step(timing.decodes + timing.prefill_tokens)
        self._pass_kv_events()
        for suspension in outcome.suspended:
            suspended = self.turns.get(suspension.request.request_id)
            if suspended is not None:
                self.tracer.suspended(suspended, suspension)
        asked = []
        for request in outcome.finished:
            turn = self.turns.get(request.request_id)
            if turn is not None and self._end(turn):
                asked.append(turn)
        self.text.ask(asked + self.text.grown(outcome.new_tokens))
        if self.text.has_due and not self.engine.has_work():  # no wait comes: now
            self.text.follow_due()
        if self._timed:  # turns with a timeout, or cancelled while suspended
            now = time.monotonic()
            for turn in [t for t in self._timed.values() if (t.cancel_at or 0.0) <= now]:
                self._end_early(turn)

    def cancel(self, conv_id: str, tenant: str | None = None) -> bool:
        """End the conversation's turn in flight now, as its requester asks: what it generated
        so far is its reply (committed as a turn with finish_reason "cancelled"; one that
        generated nothing is answered `cancelled` and leaves no turn), its KV kept as after a
        normal end. False if it has no turn in flight."""
        conv = self.convs.in_memory(conv_id, tenant)
        turn = next((t for t in self.turns.values() if t.conv is conv), None)
        if conv is None or turn is None:
            return False  # stored and idle, or idle
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
        self.text.clear()

    # ---- the reply's text, from the tokenizer actor ---------------------------------------

    def apply_text(self, reply: DetokenizeReply) -> None:
        """The tokenizer's answer to pieces of replies (`ReplyText.apply`)."""
        self.text.apply(reply)

    def text_failed(self, request: DetokenizeRequest, error: ApiError) -> None:
        """No tokenizer answered `request`: its turns end with `error`, their conversations as
        before them (the engine stops those still running)."""
        for piece in request.pieces:
            turn = self.turns.pop(piece.key, None)
            if turn is None:
                continue
            self.text.unfollow(piece.key)
            self._timed.pop(piece.key, None)
            if not turn.ended:
                self.engine.cancel(turn.request)
            turn.conv.busy = False
            turn.sink.error(error)

    def trace_drops(self, conv_ids_dropped: dict[str, int]) -> None:
        """Trace chunks of idle conversations leaving the cache (`TurnTracer.drops`)."""
        self.tracer.drops(conv_ids_dropped)

    # ---- internals -----------------------------------------------------------------------

    def _pass_kv_events(self) -> None:
        """The chunk events since the last call, to the publisher."""
        events = self.engine.take_kv_events()
        if events:
            self.metrics.count_kv_events(events)
            if self.publish_kv is not None:
                self.publish_kv(events)
            if tracing.enabled():
                self.tracer.kv_leaving(events)

    def _forget_kv(self, conv_id: str) -> None:
        self.engine.forget(conv_id)
        self._pass_kv_events()

    def _cancel(self, turn: Turn) -> None:
        if turn.ended:  # its text is being found; it ends with the tokens it has
            return
        turn.cancel_at = -math.inf
        self._timed[turn.request.request_id] = turn  # tried again each step until it ends
        self._end_early(turn)

    def _end_early(self, turn: Turn) -> None:
        """End a turn whose time is up; one suspended now ends once it runs again."""
        if self.engine.cancel(turn.request) and self._end(turn):
            self.text.ask([turn])

    def _stop_at(self, turn: Turn, num_output: int) -> None:
        """A stop string ends the turn's reply after `num_output` tokens."""
        if self.engine.stop_at(turn.request, num_output) and not turn.ended:
            self._end(turn)

    def _end(self, turn: Turn) -> bool:
        """The engine is done with `turn`. True if its final text is to be found; a turn that
        failed, or was cancelled before its first token, is answered at once."""
        key = turn.request.request_id
        turn.ended = True
        self._turns_ended = True
        self.text.unfollow(key)
        self._timed.pop(key, None)
        request = turn.request
        cancelled = request.finish_reason is FinishReason.CANCELLED
        if request.finish_reason is FinishReason.ABORT or (cancelled and not request.output_ids):
            self._complete(turn)
            return False
        return True

    def _complete(self, turn: Turn) -> None:
        """Answer the turn: an error if it produced nothing, else commit it (`turn_commit.py`)."""
        request, conv = turn.request, turn.conv
        del self.turns[request.request_id]
        if self._turns_ended and self.publish_load is not None:
            self._turns_ended = False
            self.publish_load()
        if request.finish_reason is FinishReason.ABORT:
            conv.busy = False
            code = "too_long" if (request.error or "").startswith("too_long") else "internal"
            turn.sink.error(ApiError(code, request.error or "the turn was aborted"))
            return
        if request.finish_reason is FinishReason.CANCELLED and not request.output_ids:
            conv.busy = False
            if conv.turns == 0:  # a conversation this turn would have made: none is left
                self.convs.by_id.pop(conv.conv_id, None)
                self._forget_kv(conv.conv_id)
            turn.sink.error(
                ApiError(
                    "cancelled", "the turn was cancelled before its first token; nothing was stored"
                )
            )
            return
        text = self.text.finish(turn)
        user, results = last_sent(turn.messages)
        calls = tuple(call.as_openai() for call in turn.tool_calls)
        sent = len(results) + (1 if turn.messages[-1]["role"] == "user" else 0)
        history = history_of(conv, turn.messages[: len(turn.messages) - sent])
        record = turn_record(
            conv.turns, user, text, request, turn.started_at, history, results, calls
        )
        record = dataclasses.replace(record, **turn.structure)
        self.tracer.finished(turn, record)
        log = request.all_ids
        stored = self.commits.submit(turn, record, log)
        if turn.final:  # its KV is of no use any more; if the commit fails, the next turn
            self._forget_kv(conv.conv_id)  # recomputes it from the stored log
        self.commits.answer_when_stored(stored, turn, text, record, log)
