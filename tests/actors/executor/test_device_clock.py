"""The device clock counts the time the device waits for the host between steps (GPU only)."""

from __future__ import annotations

import time

import pytest
import torch

from pensieve.actors.executor.device_clock import DeviceClock

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(clock: DeviceClock, x: torch.Tensor, continues: bool) -> None:
    start = clock.start()
    for _ in range(20):
        x = x @ x
    clock.end(start, continues)


def test_a_late_host_shows_as_idle_time_and_a_gap_between_busy_periods_does_not() -> None:
    clock, x = DeviceClock(), torch.randn(1024, 1024, device="cuda") / 32
    _step(clock, x, continues=False)
    time.sleep(0.2)  # the host is late: the device waits
    _step(clock, x, continues=True)
    time.sleep(0.2)  # out of work: not the host's fault
    _step(clock, x, continues=False)
    torch.cuda.synchronize()
    measured = clock.read()
    assert 0.15 < measured.idle_s < 0.3
    assert measured.busy_s > 0 and 0 < measured.idle_fraction < 1


def test_steps_queued_ahead_leave_no_idle_time() -> None:
    clock, x = DeviceClock(), torch.randn(1024, 1024, device="cuda") / 32
    for i in range(10):
        _step(clock, x, continues=i > 0)
    torch.cuda.synchronize()
    assert clock.read().idle_s < 0.01 * clock.read().busy_s + 1e-4
