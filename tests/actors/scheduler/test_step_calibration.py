"""The step-time estimate held to measured step times (pure)."""

from __future__ import annotations

import pytest

from pensieve.actors.scheduler.step_calibration import BOUND, StepCalibration


def test_before_any_measurement_the_estimate_stands() -> None:
    c = StepCalibration()
    assert (c.decode, c.prefill, c.scale) == (1.0, 1.0, 1.0)
    c.observe(decode_s=0.01, prefill_s=0.0, measured_s=0.0)  # not measured (a CPU runner)
    assert c.scale == 1.0


def test_decodes_and_prefill_are_each_held_to_their_measurements() -> None:
    c = StepCalibration()
    for _ in range(50):
        c.observe(decode_s=0.010, prefill_s=0.0, measured_s=0.015)  # decodes: 1.5x
    assert c.decode == pytest.approx(1.5)
    for _ in range(50):
        # the prefill estimated at 5 ms took 20: what is left after the decodes at 1.5x
        c.observe(decode_s=0.010, prefill_s=0.005, measured_s=0.015 + 0.020)
    assert c.prefill == pytest.approx(4.0)
    assert c.scale == pytest.approx(1.5 / 4.0)


def test_recent_steps_weigh_most() -> None:
    c = StepCalibration(decay=0.5)
    for _ in range(20):
        c.observe(0.01, 0.0, 0.03)
    for _ in range(20):
        c.observe(0.01, 0.0, 0.01)
    assert c.decode == pytest.approx(1.0, rel=1e-4)


def test_a_sliver_of_prefill_does_not_move_its_ratio() -> None:
    c = StepCalibration(min_share=0.1)
    c.observe(decode_s=0.010, prefill_s=0.0005, measured_s=0.5)
    assert c.prefill == 1.0


def test_the_ratios_stay_bounded() -> None:
    c = StepCalibration()
    c.observe(decode_s=1.0, prefill_s=0.0, measured_s=1e6)
    c.observe(decode_s=1.0, prefill_s=1.0, measured_s=0.5)  # less than its decodes' share
    assert c.decode == BOUND and c.prefill == 1 / BOUND


def test_a_bad_decay_is_refused() -> None:
    with pytest.raises(ValueError, match="decay"):
        StepCalibration(decay=1.0)
