"""How much of its time the device spends waiting for the host between steps.

Each step launched on a CUDA device is bracketed by two timing events on the compute stream. The
stream reaches a step's start event as soon as the step before it has finished if the host
queued the step in time; if not, the stream sat idle until then. So for a step fed by the one
before it (a decoding batch that goes on), `end(N) -> start(N+1)` is device idle time caused by
the host, and `start -> end` is the step's own device time. Gaps after a step that nothing
followed (the engine ran out of work) are not counted.
"""

from __future__ import annotations

import torch

from pensieve.actors.wire.step import DeviceTime


class DeviceClock:
    def __init__(self) -> None:
        self.time = DeviceTime()
        # (end of the step before if this one continues it, start, end), not yet folded in
        self._pending: list[tuple[torch.cuda.Event | None, torch.cuda.Event, torch.cuda.Event]] = []
        self._last_end: torch.cuda.Event | None = None

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
