"""The executor's spans of a request: one prefill and one decode per stretch of steps it runs in,
in the request's trace; written once its last step's tokens are on the host, whichever of
launching and waiting comes first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pensieve.actors.executor.step_tracing import StepTracer
from pensieve.actors.wire.step import SamplingParams, SeqPiece, StepPlan
from pensieve.ops.telemetry import setup_tracing

SAMPLED = SamplingParams()
TRACE_A = f"00-{0xA:032x}-{0x1:016x}-01"
TRACE_B = f"00-{0xB:032x}-{0x2:016x}-01"
CONTEXTS = {"a": TRACE_A, "b": TRACE_B}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    installed = setup_tracing(exporter)
    assert installed is not None
    yield exporter
    installed.shutdown()


def plan(*pieces: tuple[str, bool]) -> StepPlan:
    """A step of one piece per (request id, whether it samples)."""
    return StepPlan(
        tuple(
            SeqPiece(rid, (1,), 0, 1, (0,), SAMPLED if sampled else None) for rid, sampled in pieces
        )
    )


def by_trace(spans: InMemorySpanExporter) -> dict[int, dict[str, ReadableSpan]]:
    found: dict[int, dict[str, ReadableSpan]] = {}
    for span in spans.get_finished_spans():
        found.setdefault(span.context.trace_id, {})[span.name] = span
    return found


def test_spans_wait_for_the_last_step_and_follow_the_first_token(spans) -> None:
    tracer = StepTracer()
    # as the engine steps one ahead: launch N+1, then wait for N
    one = tracer.launched(plan(("a", False), ("b", True)), CONTEXTS.get)  # a's prompt chunk
    two = tracer.launched(plan(("a", True), ("b", True)), CONTEXTS.get)
    tracer.done(one)
    three = tracer.launched(plan(("a", True)), CONTEXTS.get)  # b has left
    assert spans.get_finished_spans() == ()  # its last step is still running
    tracer.done(two)
    b = by_trace(spans)[0xB]
    assert set(b) == {"prefill", "decode"}
    assert b["prefill"].end_time == b["decode"].start_time  # its first token, after step one
    assert b["decode"].end_time is not None and b["decode"].end_time >= b["prefill"].end_time
    assert b["prefill"].parent is not None and b["prefill"].parent.span_id == 0x2
    four = tracer.launched(plan(), CONTEXTS.get)
    tracer.done(three)
    tracer.done(four)
    a = by_trace(spans)[0xA]
    assert set(a) == {"prefill", "decode"}
    assert a["prefill"].end_time == a["decode"].start_time
    assert a["decode"].end_time > b["decode"].end_time  # type: ignore[operator]
    assert {s.resource.attributes["service.name"] for s in a.values()} == {"pensieve-executor"}


def test_a_request_out_of_one_step_has_spans_per_stretch_and_a_reset_forgets(spans) -> None:
    tracer = StepTracer()
    for pieces in ([("b", True)], [], [("b", True)], []):
        tracer.done(tracer.launched(plan(*pieces), CONTEXTS.get))
    assert [s.name for s in spans.get_finished_spans()] == ["prefill", "decode"] * 2
    tracer.launched(plan(("b", True)), CONTEXTS.get)  # never done: the step failed
    tracer.reset()
    tracer.done(tracer.launched(plan(), CONTEXTS.get))
    assert len(spans.get_finished_spans()) == 4
    untraced = tracer.launched(plan(("c", True)), CONTEXTS.get)
    tracer.done(untraced)
    tracer.done(tracer.launched(plan(), CONTEXTS.get))
    assert len(spans.get_finished_spans()) == 4
