"""How much of its time the device spends waiting for the host between steps.

Each step launched on a CUDA device is bracketed by two timing events on the compute stream. The
stream reaches a step's start event as soon as the step before it has finished if the host
queued the step in time; if not, the stream sat idle until then. So for a step fed by the one
before it (a decoding batch that goes on), `end(N) -> start(N+1)` is device idle time caused by
the host, and `start -> end` is the step's own device time. Gaps after a step that nothing
followed (the engine ran out of work) are not counted.

It also tells when a timing event completed on the host's clock (`epoch_ns`), for spans of
work timed on the device: from an anchor, an event the host saw complete as it waited for it
(`waited`), and the device's time between the two.
"""

from __future__ import annotations

import time

import torch

from pensieve.actors.wire.step import DeviceTime


class DeviceClock:
    def __init__(self) -> None:
        self.time = DeviceTime()
        # (end of the step before if this one continues it, start, end), not yet folded in
        self._pending: list[tuple[torch.cuda.Event | None, torch.cuda.Event, torch.cuda.Event]] = []
        self._last_end: torch.cuda.Event | None = None
        # a timing event, and when it completed (ns since the epoch)
        self._anchor: tuple[torch.cuda.Event, int] | None = None

    def start(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end(self, start: torch.cuda.Event, continues: bool) -> None:
        """The step begun at `start` is queued; `continues`: it is fed by the step before."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((self._last_end if continues else None, start, end))
        self._last_end = end

    def read(self) -> DeviceTime:
        """The totals, with every step the device has finished folded in (waits for none)."""
        while self._pending and self._pending[0][2].query():
            before, start, end = self._pending.pop(0)
            self.time.busy_s += start.elapsed_time(end) / 1000.0
            if before is not None:
                self.time.idle_s += max(before.elapsed_time(start), 0.0) / 1000.0
        return self.time

    def waited(self, event: torch.cuda.Event) -> None:
        """The host has just seen the timing event `event` complete, having waited for it:
        later times are reckoned from it, as the device's clock drifts from the host's."""
        self._anchor = (event, time.time_ns())

    def epoch_ns(self, event: torch.cuda.Event) -> int:
        """When the completed timing event `event` completed, in ns since the epoch (the first
        call without an anchor waits for the current stream once, to make one)."""
        if self._anchor is None:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self.waited(anchor)
        assert self._anchor is not None
        anchor, anchor_ns = self._anchor
        after_ms = anchor.elapsed_time(event)
        if after_ms <= 0.0:  # before the anchor (an earlier step's copies, read late)
            after_ms = -event.elapsed_time(anchor)
        return anchor_ns + int(after_ms * 1e6)
