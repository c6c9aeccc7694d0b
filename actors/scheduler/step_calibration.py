"""The step-time estimate held to what the device measures (pure).

`StepTimeModel` estimates a step from the cost model and the weights' read; either may be off on
a given card (an analytic cost model assumes a matrix rate and a bandwidth; attention over a long
context at a few dozen queries runs far from either). Each step the engine applies, it tells
`observe` how long the device spent on it (`DeviceTime.busy_s`, timed by events on the stream)
and what the step held; two ratios follow:

- `decode`: measured over estimated, over steps that only decode;
- `prefill`: of steps with prefill, what is left of the measurement once their decodes are
  taken at the decode ratio, over the prefill's estimate.

Each is a ratio of decayed sums (each step weighs `decay` times the one after it), so a step
whose time the clock folds in late (counted with the next) moves both sums alike. The prefill
budget then scales its allowance by `decode / prefill`: a prefill that costs twice its estimate
gets half the estimated seconds. Both start at 1 (the estimate as it is) and stay within
[1/`BOUND`, `BOUND`].
"""

from __future__ import annotations

from collections.abc import Sequence

BOUND = 20.0


class StepCalibration:
    def __init__(self, decay: float = 0.9, min_share: float = 0.1) -> None:
        """`min_share`: a step's prefill counts only if its estimate is at least this share
        of its decodes' (less is mostly noise of the decode time)."""
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_share = min_share
        self._decode = [0.0, 0.0]  # decayed sums: measured, estimated
        self._prefill = [0.0, 0.0]

    @property
    def decode(self) -> float:
        return _ratio(self._decode)

    @property
    def prefill(self) -> float:
        return _ratio(self._prefill)

    @property
    def scale(self) -> float:
        """What the prefill allowance, in estimated seconds, is multiplied by."""
        return self.decode / self.prefill

    def observe(self, decode_s: float, prefill_s: float, measured_s: float) -> None:
        """A step estimated at `decode_s` for its decodes and the fixed cost and `prefill_s`
        for its prefill took `measured_s` on the device (0: not measured, ignored)."""
        if measured_s <= 0 or decode_s <= 0:
            return
        if prefill_s <= 0:
            _add(self._decode, measured_s, decode_s, self.decay)
        elif prefill_s >= self.min_share * decode_s:
            left = max(measured_s - self.decode * decode_s, 0.0)
            _add(self._prefill, left, prefill_s, self.decay)


def _add(sums: list[float], measured: float, estimated: float, decay: float) -> None:
    sums[0] = sums[0] * decay + measured
    sums[1] = sums[1] * decay + estimated


def _ratio(sums: Sequence[float]) -> float:
    if sums[1] <= 0:
        return 1.0
    return min(max(sums[0] / sums[1], 1 / BOUND), BOUND)
