"""The executor's spans of each request it runs, from its own step times (no I/O but the spans).

A request runs in a *stretch* of consecutive steps: from the step that brings it to the executor
(in full: its trace context comes with it) to the last step before one that leaves it out (both
sides of the step channel forget it then). When a stretch ends, its spans go out under the
request's trace:

    first step launched       first token on the host           last step's tokens on the host
    |-------- prefill -------------|------------- decode ------------------|

A turn that sits out a step (suspended, or left out of a full step) has one set per stretch.
The copies of its KV are the swap manager's spans (`swap_tracing.py`).

`launched` is called as each step is launched and `done` as its tokens reach the host, each in
step order but possibly from two threads (the executor actor launches on one and waits on
another), so a stretch that leaves the plan before its last step is done waits for it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from pensieve.actors.wire import tracing
from pensieve.actors.wire.step import StepPlan, TraceContexts

_RECENT_STEPS = 8  # done times kept: a stretch ends at most a step or two after its last step


@dataclass
class _Stretch:
    traceparent: str
    began_ns: int  # its first step launched (host clock, ns since the epoch)
    last_step: int = 0
    first_token_step: int | None = None  # the step that samples its first token here
    first_token_ns: int | None = None  # when that token reached the host


class StepTracer:
    """Each request's stretches of steps, as prefill / decode spans."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_steps = 0  # steps launched, numbered from 1; never reset
        self._running: dict[str, _Stretch | None] = {}  # the last step's requests (None: untraced)
        self._first_tokens: dict[int, list[_Stretch]] = {}  # step -> whose first token it samples
        self._leaving: list[_Stretch] = []  # left the plan; their last step is not done yet
        self._done_ns: dict[int, int] = {}  # recent steps -> when their tokens reached the host
        self._done_through = 0

    def launched(self, plan: StepPlan, contexts: TraceContexts) -> int:
        """A step is being launched; its number, for `done`. `contexts` is asked once for each
        request new to the executor."""
        now = time.time_ns()
        with self._lock:
            self._num_steps += 1
            step = self._num_steps
            before = self._running
            running: dict[str, _Stretch | None] = {}
            for piece in plan.pieces:
                rid = piece.request_id
                if rid in before:
                    stretch = before.pop(rid)
                elif rid in running:  # a second piece of the request in this step
                    stretch = running[rid]
                else:
                    stretch = _start(contexts(rid), now)
                running[rid] = stretch
                if stretch is not None:
                    stretch.last_step = step
                    if piece.sampling is not None and stretch.first_token_step is None:
                        stretch.first_token_step = step
                        self._first_tokens.setdefault(step, []).append(stretch)
            self._running = running
            self._leaving += [s for s in before.values() if s is not None]
            ended = self._ended()
        _emit(ended)
        return step

    def done(self, step: int) -> None:
        """Step `step`'s sampled tokens are on the host."""
        now = time.time_ns()
        with self._lock:
            for stretch in self._first_tokens.pop(step, ()):
                stretch.first_token_ns = now
            self._done_ns[step] = now
            if len(self._done_ns) > _RECENT_STEPS:  # done in step order: the first is oldest
                del self._done_ns[next(iter(self._done_ns))]
            self._done_through = max(self._done_through, step)
            ended = self._ended()
        _emit(ended)

    def reset(self) -> None:
        """Forget every request (after a failed step: their steps will never be done)."""
        with self._lock:
            self._running, self._leaving = {}, []
            self._first_tokens.clear()
            self._done_ns.clear()

    def _ended(self) -> list[tuple[_Stretch, int]]:
        """The stretches that left the plan and whose last step is done, with its time."""
        if not self._leaving:
            return []
        through, done_ns = self._done_through, self._done_ns
        ended = [
            (s, done_ns[s.last_step])
            for s in self._leaving
            if s.last_step <= through and s.last_step in done_ns
        ]
        if ended:
            self._leaving = [s for s in self._leaving if s.last_step > through]
        return ended


def _start(traceparent: str | None, now: int) -> _Stretch | None:
    return _Stretch(traceparent, now) if traceparent else None


def _emit(ended: list[tuple[_Stretch, int]]) -> None:
    for stretch, end_ns in ended:
        parent = tracing.parent_context(stretch.traceparent)
        token_ns = stretch.first_token_ns
        executor = tracing.tracer("executor")
        _span(executor, "prefill", parent, stretch.began_ns, token_ns or end_ns)
        if token_ns is not None:
            _span(executor, "decode", parent, token_ns, end_ns)


def _span(tracer: trace.Tracer, name: str, parent: Context, start_ns: int, end_ns: int) -> None:
    span = tracer.start_span(name, parent, start_time=start_ns)
    span.end(end_time=max(start_ns, end_ns))
