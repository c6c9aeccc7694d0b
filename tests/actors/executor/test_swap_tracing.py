"""The swap manager's spans of a step's copies: one per conversation and kind of copy, in its
turn's trace or linked to its last turn, lasting as long as the copies themselves ran (the host
clock around them on the CPU, their timing events on their CUDA copy stream)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pensieve.actors.executor.device_clock import DeviceClock
from pensieve.actors.executor.swap import SwapEngine
from pensieve.actors.executor.swap_tracing import SwapTracer
from pensieve.actors.wire.step import CopyKind, CopyOp, CopyTrace, SwapOrders
from pensieve.ops.telemetry import setup_tracing

TURN = f"00-{0xA:032x}-{0x1:016x}-01"  # the turn in flight of conversation "a"
LAST = f"00-{0xB:032x}-{0x2:016x}-01"  # the last turn of the idle conversation "b"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    installed = setup_tracing(exporter)
    assert installed is not None
    yield exporter
    installed.shutdown()


def tiers(device: str, pin: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """4 layers of 64 blocks on each tier; a block is 1 MiB over its 4 layers."""
    shape = (64, 2, 32, 8, 128)  # [blocks, K/V, block size, heads, head dim] float32
    gpu = [torch.randn(shape, device=device) for _ in range(4)]
    cpu = [torch.randn(shape, pin_memory=pin) for _ in range(4)]
    return gpu, cpu


def duration_s(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


def test_each_conversations_copies_are_a_span_as_long_as_the_host_took(spans) -> None:
    engine = SwapEngine(*tiers("cpu", pin=False))
    tracer = SwapTracer(engine.block_bytes)
    # a's history comes back while b's chunks leave: some reused at once, some ahead of time
    orders = SwapOrders(
        evict_first=[CopyOp(40 + i, 40 + i) for i in range(8)],
        swap_in=[CopyOp(i, i) for i in range(16)],
        swap_out=[CopyOp(20 + i, 20 + i) for i in range(4)],
    )
    traces = (
        CopyTrace(CopyKind.SWAP_IN, "a", 16, parent=TURN),
        CopyTrace(CopyKind.EVICT_FIRST, "b", 8, link=LAST),
        CopyTrace(CopyKind.SWAP_OUT, "b", 4, link=LAST),
    )
    began = time.time_ns()
    engine.issue(orders)
    tracer.issued(traces, engine.windows)
    ended = time.time_ns()
    found = {
        (s.name, bool((s.attributes or {}).get("pensieve.evict_first"))): s
        for s in spans.get_finished_spans()
    }
    assert set(found) == {("kv.swap_in", False), ("kv.swap_out", True), ("kv.swap_out", False)}
    swap_in = found["kv.swap_in", False]
    assert swap_in.parent is not None and swap_in.parent.span_id == 0x1
    assert swap_in.context.trace_id == 0xA and not swap_in.links
    assert dict(swap_in.attributes or {}) == {
        "pensieve.conversation_id": "a",
        "pensieve.blocks": 16,
        "pensieve.bytes": 16 * engine.block_bytes,
    }
    # the host clock around the copies: what the swap totals count too
    assert duration_s(swap_in) > 0
    assert duration_s(swap_in) == pytest.approx(engine.stats.seconds_in, abs=1e-6)
    out_s = [duration_s(found["kv.swap_out", evict]) for evict in (True, False)]
    assert all(d > 0 for d in out_s)
    assert sum(out_s) == pytest.approx(engine.stats.seconds_out, abs=2e-6)
    for span in spans.get_finished_spans():
        assert began <= span.start_time <= span.end_time <= ended  # type: ignore[operator]
        assert span.resource.attributes["service.name"] == "pensieve-swap-manager"
    for evict in (True, False):  # b is idle: a trace of its own, linked to its last turn
        out = found["kv.swap_out", evict]
        assert out.parent is None and out.context.trace_id != 0xB
        assert [(link.context.trace_id, link.context.span_id) for link in out.links] == [(0xB, 0x2)]
        assert (out.attributes or {})["pensieve.conversation_id"] == "b"
    # the copies of the earlier step were all traced: nothing is left to trace, even after a reset
    tracer.collect()
    tracer.reset()
    assert len(spans.get_finished_spans()) == 3


def test_without_copy_traces_nothing_is_traced(spans) -> None:
    engine = SwapEngine(*tiers("cpu", pin=False))
    tracer = SwapTracer(engine.block_bytes)
    engine.issue(SwapOrders(swap_in=[CopyOp(0, 0)]))
    tracer.issued((), engine.windows)
    tracer.collect()
    assert spans.get_finished_spans() == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_swap_in_span_lasts_as_long_as_its_copies_on_the_copy_stream(spans) -> None:
    engine = SwapEngine(*tiers("cuda", pin=True))
    clock = DeviceClock()
    tracer = SwapTracer(engine.block_bytes, clock)
    orders = SwapOrders(swap_in=[CopyOp(i, 63 - i) for i in range(48)])  # scattered: 48 MiB
    traces = (CopyTrace(CopyKind.SWAP_IN, "a", 48, parent=TURN),)
    torch.cuda.synchronize()
    began = time.time_ns()
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record(engine.in_stream)
    engine.issue(orders)
    after.record(engine.in_stream)
    tracer.issued(traces, engine.windows)  # read later: the copies are not waited for
    torch.cuda.synchronize()
    ended = time.time_ns()
    tracer.collect()
    (span,) = spans.get_finished_spans()
    copy_s = before.elapsed_time(after) / 1000.0  # the copy stream's own time around them
    assert copy_s > 0
    assert duration_s(span) == pytest.approx(copy_s, rel=0.2)
    # placed on the host's clock: within the time the host saw them take
    assert began - 1_000_000 <= span.start_time <= span.end_time <= ended + 1_000_000  # type: ignore[operator]
