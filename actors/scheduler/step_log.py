"""The engine thread's slowest step intervals, to find what makes a token late.

A session's next token is as late as the interval from one step's start to the next: the host
work between steps (the API calls the engine thread runs there, such as admitting a turn, and the
stats snapshot) plus the step itself, whose phases `StepTiming` splits (scheduling, launch,
waiting for the device, applying the tokens). The log keeps the `keep` longest intervals of each
`WINDOW_S` of the last `WINDOWS` with that breakdown, for the stats (`slow_steps`), so a tail seen
by clients can be put on its cause from the server's stats read before and after a load (the
intervals that ended between the two, which leaves out a warm-up's compilation).

The engine thread records; the actor's stats request reads (under the log's lock).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from pensieve.actors.scheduler.step_timing import StepTiming

KEEP = 4
WINDOW_S = 15.0
WINDOWS = 40


@dataclass
class _Between:
    """What ran on the engine thread since the last step ended."""

    began: float
    commands: int = 0
    commands_s: float = 0.0
    slowest_command: str = ""
    slowest_command_s: float = 0.0
    snapshot_s: float = 0.0


@dataclass(order=True)
class SlowStep:
    interval_s: float  # from the end of the step before to the end of this one
    at_s: float = field(compare=False)  # when it ended, seconds since the log began
    between: dict[str, Any] = field(compare=False)
    step_s: float = field(compare=False)  # the service's step call, wall
    phases: dict[str, Any] | None = field(compare=False)  # the engine's `StepTiming`
    # Triton kernels compiled in the interval: kernel, seconds, variant
    compiled: list[dict[str, Any]] = field(default_factory=list, compare=False)


class _Windows:
    """The `keep` largest records of each `WINDOW_S` window of the last `WINDOWS` (records are
    ordered by their first field). Written by one thread, read by others."""

    def __init__(self, keep: int, start: float) -> None:
        self.keep = keep
        self._start = start
        self._windows: dict[int, list[tuple[float, int, Any]]] = {}  # number -> a min-heap
        self._order = itertools.count()
        self._lock = threading.Lock()

    def offer(self, size: float, at: float, record: Callable[[], Any]) -> None:
        """A record of `size` at `at` (seconds since the log began), made only if kept."""
        window = int(at // WINDOW_S)
        kept = self._windows.get(window)
        if kept is None:
            with self._lock:
                kept = self._windows[window] = []
                for old in [w for w in self._windows if w <= window - WINDOWS]:
                    del self._windows[old]
        if len(kept) == self.keep and size <= kept[0][0]:
            return
        entry = (size, next(self._order), record())
        with self._lock:
            if len(kept) < self.keep:
                heapq.heappush(kept, entry)
            else:
                heapq.heapreplace(kept, entry)

    def largest(self) -> list[dict[str, Any]]:
        with self._lock:
            entries = sorted((e for kept in self._windows.values() for e in kept), reverse=True)
        return [asdict(e[2]) for e in entries]


class Compiled(Protocol):
    """A kernel compile (`pensieve.kernels.compile_log.CompileEvent`)."""

    kernel: str
    start_s: float  # time.perf_counter() when it began
    seconds: float
    detail: str


@dataclass
class LoopStall:
    lag_s: float  # how late the event loop woke a task that slept
    at_s: float  # when it woke, seconds since the log began


class StepLog:
    """The `keep` longest step intervals of each recent window, with where their time went, and
    the event loop's longest stalls (the scheduler actor's loop, which sends the replies)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._start = time.monotonic()
        self._between = _Between(self._start)
        self._steps = _Windows(keep, self._start)
        self._stalls = _Windows(keep, self._start)
        self._compiles: Sequence[Compiled] = ()

    def watch_compiles(self, events: Sequence[Compiled]) -> None:
        """Name with each slow interval the compiles of `events` (a log the process appends
        to, in the order they end) that began within it."""
        self._compiles = events

    def now_s(self) -> float:
        """Seconds since the log began, the clock of `at_s`."""
        return time.monotonic() - self._start

    def command(self, name: str, seconds: float) -> None:
        """An API call ran on the engine thread between steps."""
        between = self._between
        between.commands += 1
        between.commands_s += seconds
        if seconds > between.slowest_command_s:
            between.slowest_command, between.slowest_command_s = name, seconds

    def snapshot(self, seconds: float) -> None:
        self._between.snapshot_s += seconds

    def idle(self) -> None:
        """The thread had no work and slept: the next interval starts when it wakes."""
        self._between = _Between(time.monotonic())

    def stepped(self, step_s: float, timing: StepTiming | None) -> None:
        """A step call ended, taking `step_s`; `timing` is the engine's breakdown of it."""
        now = time.monotonic()
        between, self._between = self._between, _Between(now)
        interval, at = now - between.began, now - self._start
        self._steps.offer(
            interval,
            at,
            lambda: SlowStep(
                interval,
                at,
                {k: v for k, v in asdict(between).items() if k != "began"},
                step_s,
                None if timing is None else {**asdict(timing), "kind": timing.kind},
                self._compiled_within(interval),
            ),
        )

    def _compiled_within(self, interval_s: float) -> list[dict[str, Any]]:
        """The compiles that began in the last `interval_s` (newest last, at most 8)."""
        since = time.perf_counter() - interval_s
        found = []
        for event in reversed(self._compiles):
            if event.start_s < since:
                break
            variant = event.detail[:300]
            found.append({"kernel": event.kernel, "s": event.seconds, "variant": variant})
        return found[:8][::-1]

    def loop_stall(self, lag_s: float) -> None:
        """The event loop woke a sleeping task `lag_s` late (from its own thread)."""
        at = self.now_s()
        self._stalls.offer(lag_s, at, lambda: LoopStall(lag_s, at))

    def stats(self) -> dict[str, Any]:
        """The log's clock now, every kept interval and every kept stall, longest first."""
        return {
            "now_s": self.now_s(),
            "slowest": self._steps.largest(),
            "loop_stalls": self._stalls.largest(),
        }
