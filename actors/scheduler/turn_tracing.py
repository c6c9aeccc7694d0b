"""The spans of a turn, as the scheduler records them, and of its conversation's KV leaving.

A turn's request span carries the OpenTelemetry GenAI attributes beside `pensieve.*` ones; its
wait for admission is the child span "queued". The recompute planner traces its own
"kv.plan_recompute" when the turn arrives, the executor "prefill" and "decode", and the swap
manager "kv.swap_in", where they run: the executor learns each turn's trace from `context`.
Chunks of an idle conversation swapped out or dropped are spans of their own, linked to the
conversation's last turn.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from pensieve.actors.scheduler.conversations import Conversation
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.request import Request
from pensieve.actors.scheduler.turn import Turn
from pensieve.actors.wire import tracing
from pensieve.actors.wire.messages import KvEvent, KvEventKind
from pensieve.actors.wire.schemas import ChatRequest
from pensieve.actors.wire.step import RequestTrace, SamplingParams
from pensieve.store import TurnRecord


class TurnTracer:
    """Traces the turns in flight (`turns`, request id -> turn) and the conversations in memory
    (`conversations`), both read live, of `engine` (its block size in bytes, and its clock, in
    which a request's times are given)."""

    def __init__(
        self, turns: Mapping[str, Turn], conversations: Mapping[str, Conversation], engine: Engine
    ) -> None:
        self.turns = turns
        self.conversations = conversations
        self.engine = engine

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
                **genai_request(conv_id, request, sampling),
                "gen_ai.usage.input_tokens": num_prompt,
            }
        )

    def finished(self, turn: Turn, record: TurnRecord) -> None:
        """The turn's outcome as attributes of its request span, and its wait for admission as
        the child span "queued"; the span is its conversation's last."""
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
            self._trace_queued(request, trace.set_span_in_context(span))

    def context(self, request_id: str) -> RequestTrace | None:
        """The trace of a turn's request, for the executor that runs it: its span's context and
        the blocks swapped in for it (None: it is not traced)."""
        turn = self.turns.get(request_id)
        if turn is None or not turn.span.is_recording():
            return None
        return tracing.traceparent(turn.span), turn.request.swapped_in_blocks

    def kv_leaving(self, events: Sequence[KvEvent]) -> None:
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
            self.evictions(dict(moved[KvEventKind.SWAPPED_OUT]), dict(moved[KvEventKind.DROPPED]))

    def evictions(
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

    def _trace_queued(self, request: Request, parent: Context) -> None:
        offset = time.time_ns() - int(self.engine.clock() * 1e9)  # engine clock -> epoch ns
        admitted = request.admitted_at or request.arrival
        queued = tracing.tracer("scheduler").start_span(
            "queued", parent, start_time=offset + int(request.arrival * 1e9)
        )
        queued.end(end_time=offset + int(admitted * 1e9))


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
