"""The spans of a turn, as the scheduler records them, and of its conversation's KV dropped.

A turn's request span carries the OpenTelemetry GenAI attributes beside `pensieve.*` ones; its
wait for admission is the child span "queued", and each suspension an event "suspended". The
recompute planner traces its own "kv.plan_recompute" when the turn arrives, the executor
"prefill" and "decode", and the swap manager the copies ("kv.swap_in", "kv.swap_out"), where
they run: the executor learns each turn's trace from `context`, and the trace of each
conversation whose chunks a step copies from `copy_contexts`. Chunks of an idle conversation
dropped (no copy: nothing to time) are a span of the scheduler's, linked to the conversation's
last turn.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context

from pensieve.actors.scheduler.conversations import Conversation, prompt_sources
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.request import Request
from pensieve.actors.scheduler.scheduler import Suspension
from pensieve.actors.scheduler.turn import Turn
from pensieve.actors.wire import tracing
from pensieve.actors.wire.messages import KvEvent, KvEventKind
from pensieve.actors.wire.schemas import ChatRequest
from pensieve.actors.wire.step import SamplingParams
from pensieve.store import TurnRecord


class TurnTracer:
    """Traces the turns in flight (`turns`, request id -> turn) and the conversations in memory
    (`conversations`), both read live, of `engine` (its block size in bytes, and its clock, in
    which a request's times are given), which serves its model as `model` ("": unnamed)."""

    def __init__(
        self,
        turns: Mapping[str, Turn],
        conversations: Mapping[str, Conversation],
        engine: Engine,
        model: str = "",
    ) -> None:
        self.turns = turns
        self.conversations = conversations
        self.engine = engine
        self.model = model

    def started(
        self,
        span: trace.Span,
        conv: Conversation,
        request: ChatRequest,
        sampling: SamplingParams,
        num_prompt: int,
    ) -> None:
        """The turn's request as attributes of its span."""
        conv_id = conv.conv_id
        span.set_attributes(
            {
                "pensieve.conversation_id": conv_id,
                "pensieve.turn": conv.turns,
                "pensieve.prompt_tokens": num_prompt,
                **genai_request(conv_id, request, sampling, self.model),
                "gen_ai.usage.input_tokens": num_prompt,
            }
        )

    def finished(self, turn: Turn, record: TurnRecord) -> None:
        """The turn's outcome as attributes of its request span, and its wait for admission as
        the child span "queued"; the span is its conversation's last."""
        request, span = turn.request, turn.span
        sources = prompt_sources(record)
        span.set_attributes(
            {
                "pensieve.cached_tokens": sources.cached,
                **{
                    f"pensieve.prompt_sources.{k}": v
                    for k, v in msgspec.structs.asdict(sources).items()
                },
                "pensieve.completion_tokens": len(request.output_ids),
                "pensieve.finish_reason": record.finish_reason,
                "pensieve.suspensions": request.num_suspensions,
                "pensieve.swapped_in_bytes": request.swapped_in_blocks * self.engine.block_bytes,
                "pensieve.swapped_out_bytes": request.swapped_out_blocks * self.engine.block_bytes,
                "gen_ai.usage.output_tokens": len(request.output_ids),
                "gen_ai.response.finish_reasons": (record.finish_reason,),
            }
        )
        if self.model:
            span.set_attribute("gen_ai.response.model", self.model)
        turn.conv.last_span = span.get_span_context()
        if span.is_recording():
            self._trace_queued(request, trace.set_span_in_context(span))

    def suspended(self, turn: Turn, suspension: Suspension) -> None:
        """A suspension of the turn, as the event "suspended" on its span when it happened
        (its copies to the CPU tier are a "kv.swap_out" span of the swap manager's)."""
        if not turn.span.is_recording():
            return
        attributes = {
            "pensieve.kept_positions": suspension.num_positions,
            "pensieve.swapped_out_blocks": suspension.swapped_out_blocks,
            "pensieve.swapped_out_bytes": suspension.swapped_out_blocks * self.engine.block_bytes,
        }
        turn.span.add_event("suspended", attributes, timestamp=self._epoch_ns(suspension.at))

    def context(self, request_id: str) -> str | None:
        """The trace of a turn's request, for the executor that runs it: its span's context
        (None: it is not traced)."""
        turn = self.turns.get(request_id)
        if turn is None or not turn.span.is_recording():
            return None
        return tracing.traceparent(turn.span)

    def copy_contexts(self, conv_ids: Collection[str]) -> dict[str, tuple[str, str]]:
        """The traces the copies of each conversation's chunks go in (`CopyTrace`): (its turn
        in flight, its last turn), each a traceparent or ""."""
        in_flight = {
            turn.conv.conv_id: turn
            for turn in self.turns.values()
            if turn.conv.conv_id in conv_ids and turn.span.is_recording()
        }
        found = {}
        for conv_id in conv_ids:
            turn = in_flight.get(conv_id)
            if turn is not None:
                found[conv_id] = (tracing.traceparent(turn.span), "")
                continue
            conv = self.conversations.get(conv_id)
            last = conv.last_span if conv is not None else trace.INVALID_SPAN_CONTEXT
            found[conv_id] = ("", tracing.traceparent(trace.NonRecordingSpan(last)))
        return found

    def kv_leaving(self, events: Sequence[KvEvent]) -> None:
        """Chunks of idle conversations dropped, as spans linked to their last turn."""
        dropped: Counter[str] = Counter()
        for event in events:
            if event.kind is not KvEventKind.DROPPED:
                continue
            conv = self.conversations.get(event.conversation_id)
            if not (conv is not None and conv.busy):
                dropped[event.conversation_id] += 1
        if dropped:
            self.drops(dict(dropped))

    def drops(self, conv_ids_dropped: dict[str, int]) -> None:
        """Trace chunks of idle conversations leaving the cache (conversation id -> its number
        of chunks): one span per conversation, the scheduler's (whose cache manager drops
        them), in a trace of its own linked to the conversation's last turn (no link if it has
        none here). A drop moves nothing: the span marks when it was decided."""
        scheduler = tracing.tracer("scheduler")
        for conv_id, num_chunks in conv_ids_dropped.items():
            conv = self.conversations.get(conv_id)
            last = conv.last_span if conv is not None else trace.INVALID_SPAN_CONTEXT
            links = [trace.Link(last)] if last.is_valid else []
            attributes = {"pensieve.conversation_id": conv_id, "pensieve.chunks": num_chunks}
            scheduler.start_span("kv.drop", Context(), links=links, attributes=attributes).end()

    def _epoch_ns(self, at: float) -> int:
        """A time of the engine's clock, in ns since the epoch."""
        return time.time_ns() - int((self.engine.clock() - at) * 1e9)

    def _trace_queued(self, request: Request, parent: Context) -> None:
        admitted = request.admitted_at or request.arrival
        queued = tracing.tracer("scheduler").start_span(
            "queued", parent, start_time=self._epoch_ns(request.arrival)
        )
        queued.end(end_time=self._epoch_ns(admitted))


def genai_request(
    conv_id: str, request: ChatRequest, sampling: SamplingParams, model: str = ""
) -> dict[str, Any]:
    """The OpenTelemetry GenAI semantic-convention attributes of a chat request (to the model
    served as `model`; "": unnamed)."""
    attributes = {
        "gen_ai.operation.name": "chat" if request.prompt is None else "text_completion",
        "gen_ai.provider.name": "pensieve",
        "gen_ai.system": "pensieve",  # the older name of gen_ai.provider.name
        "gen_ai.conversation.id": conv_id,
        "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_p": request.top_p,
    }
    if request.top_k is not None:
        attributes["gen_ai.request.top_k"] = request.top_k
    if model:
        attributes["gen_ai.request.model"] = model
    if sampling.seed is not None:  # the one sampled with, also when the service chose it
        attributes["gen_ai.request.seed"] = sampling.seed
    return attributes
