"""The swap manager's spans: each step's copies, timed where they run.

A traced step plan says whose chunks its copies move (`CopyTrace`: per kind of copy and
conversation, and the trace it goes in); the swap engine says when each kind ran
(`CopyWindow`). Once a step's copies are done, each of its `CopyTrace`s is one span of the swap
manager, in the process that ran the copies:

    kv.swap_in    CPU -> GPU copies of a turn's history, as the turn is (re)admitted
    kv.swap_out   GPU -> CPU copies: ahead of time, or of blocks the step reuses at once
                  (`pensieve.evict_first`), as when a running turn is suspended

from the copies' start to their end: on CUDA the timing events around them on their copy
stream, read once they are done (after the step's tokens reach the host, or at a later step:
nothing waits for them), else the host clock around them. A span goes in the trace of the
conversation's turn in flight, else in a trace of its own linked to the conversation's last
turn. The evict-first copies of a step and its swap-ins are issued between each other's layers
on one stream, so their spans share one window.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context

from pensieve.actors.executor.device_clock import DeviceClock
from pensieve.actors.executor.swap import CopyWindow
from pensieve.actors.wire import tracing
from pensieve.actors.wire.step import CopyKind, CopyTrace

_Copies = tuple[tuple[CopyTrace, ...], dict[CopyKind, CopyWindow]]


class SwapTracer:
    """The copies of the steps issued and not yet traced; `clock` reads timing events (None:
    every window is on the host clock). `block_bytes`: what one copied block moves."""

    def __init__(self, block_bytes: int, clock: DeviceClock | None = None) -> None:
        self.block_bytes = block_bytes
        self.clock = clock
        self._lock = threading.Lock()  # issued by the worker, collected by the reporter too
        self._pending: list[_Copies] = []

    def issued(self, traces: tuple[CopyTrace, ...], windows: Mapping[CopyKind, CopyWindow]) -> None:
        """A step's copies were issued (`SwapEngine.windows`); traced as soon as they are done."""
        if not traces:
            return
        with self._lock:
            self._pending.append((traces, dict(windows)))
        self.collect()

    def collect(self) -> None:
        """Trace the copies that are done (asks the device, never waits)."""
        with self._lock:
            done: list[_Copies] = []
            waiting: list[_Copies] = []
            for copies in self._pending:
                (done if all(w.done() for w in copies[1].values()) else waiting).append(copies)
            self._pending = waiting
        for traces, windows in done:
            for copied in traces:
                window = windows.get(copied.kind)
                if window is not None:
                    self._span(copied, *self._times(window))

    def reset(self) -> None:
        """Forget the copies in flight (after a failed step: they may never complete)."""
        with self._lock:
            self._pending.clear()

    def _times(self, window: CopyWindow) -> tuple[int, int]:
        if window.events is None:
            return window.start_ns, window.end_ns
        assert self.clock is not None, "timing events without a device clock"
        start, end = window.events
        start_ns = self.clock.epoch_ns(start)
        return start_ns, start_ns + int(start.elapsed_time(end) * 1e6)

    def _span(self, copied: CopyTrace, start_ns: int, end_ns: int) -> None:
        attributes: dict[str, str | int | bool] = {
            "pensieve.conversation_id": copied.conversation_id,
            "pensieve.blocks": copied.num_blocks,
            "pensieve.bytes": copied.num_blocks * self.block_bytes,
        }
        if copied.kind is CopyKind.EVICT_FIRST:
            attributes["pensieve.evict_first"] = True
        if copied.parent:
            parent, links = tracing.parent_context(copied.parent), []
        else:
            parent = Context()  # a trace of its own
            last = trace.get_current_span(tracing.parent_context(copied.link)).get_span_context()
            links = [trace.Link(last)] if last.is_valid else []
        name = "kv.swap_in" if copied.kind is CopyKind.SWAP_IN else "kv.swap_out"
        span = tracing.tracer("swap-manager").start_span(
            name, parent, links=links, attributes=attributes, start_time=start_ns
        )
        span.end(end_time=max(start_ns, end_ns))
