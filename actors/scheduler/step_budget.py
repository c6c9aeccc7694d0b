"""A decode-aware prefill budget: how many prompt tokens a step may take beside its decodes.

A step that carries 2,048 prompt tokens takes several times as long as one that only decodes, and
every running session waits for it. While sessions decode, the prefill tokens of a step are capped
so that the step's estimated time stays within `max_slowdown` times that of the same step without
them; with no decode running, prefill takes the step's whole token budget.

The estimate (`StepTimeModel`), in seconds, for a step of N tokens:

    T = F + t·N + Σ_decodes A(l_i) + Σ_prefill chunks A(l_c)·q_c/C

- F, the fixed cost: the weights are read once per step (their bytes over the memory
  bandwidth); this dominates a decode step.
- t = non_attention_s / C: projections, MLP and norms per token (the cost model's per-chunk
  non-attention time, C tokens a chunk).
- A(l): attention of one chunk of C queries over l positions (the cost model's
  `attention_cost`). A prefill chunk of q_c of its tokens ending at position l_c costs
  A(l_c)·q_c/C; a decode attending to l positions is taken as A(l), a whole chunk's: it reads
  the same K/V, and that read bounds both (an upper bound where it does not).

So a step with decodes at contexts l_i may add prefill tokens while their cost
t·q + Σ A(l_c)·q_c/C stays within (max_slowdown - 1)·T_decode, where
T_decode = F + t·D + Σ A(l_i). A floor of `min_tokens` per step keeps a long prompt moving
however small that allowance is. The estimate is held to the device's measurements
(`step_calibration.py`): the allowance is scaled by how far decodes and prefill each ran from
their estimates. Where several prompts want prefill, a long one takes at most half of a step's
allowance (`StepPrefill`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pensieve.actors.scheduler.kv.cost_model import DEFAULT_BYTES_PER_S, CostModel
from pensieve.actors.scheduler.step_calibration import StepCalibration
from pensieve.actors.wire.step import StepPlan


@dataclass(frozen=True)
class StepTimeModel:
    """Estimated seconds of a step (module doc): `fixed_s` once, then per token and per chunk
    of attention as `cost` says."""

    cost: CostModel
    fixed_s: float

    def __post_init__(self) -> None:
        if self.fixed_s < 0:
            raise ValueError(f"fixed_s must be >= 0, got {self.fixed_s}")

    @classmethod
    def from_cost(
        cls, cost: CostModel, weight_bytes: int, bytes_per_s: float = DEFAULT_BYTES_PER_S
    ) -> StepTimeModel:
        """The cost model's per-token and attention times, and the weights' read as the fixed
        cost (`weight_bytes`: what one step reads of them on one device)."""
        return cls(cost, weight_bytes / bytes_per_s)

    @property
    def per_token_s(self) -> float:
        return self.cost.non_attention_s / self.cost.chunk_size

    def decode_s(self, contexts: Sequence[int]) -> float:
        """A step of decodes only, one attending to each of `contexts` positions."""
        attention = sum(self.cost.attention_cost(n) for n in contexts)
        return self.fixed_s + self.per_token_s * len(contexts) + attention

    def prefill_s(self, start: int, num_tokens: int) -> float:
        """What positions [start, start + num_tokens) of one sequence add to a step."""
        return sum(n * rate for n, rate in self._segments(start, start + num_tokens))

    def prefill_tokens_within(self, start: int, seconds: float, at_most: int) -> int:
        """The most positions from `start` on (up to `at_most`) that add at most `seconds`."""
        taken = 0
        for n, rate in self._segments(start, start + at_most):
            fits = n if n * rate <= seconds else min(n, max(0, int(seconds / rate)))
            taken += fits
            seconds -= fits * rate
            if fits < n:
                break
        return taken

    def _segments(self, start: int, end: int) -> list[tuple[int, float]]:
        """[start, end) cut at chunk boundaries: (positions, seconds per position) for each;
        a position pays its share of the attention of the whole chunk it is in."""
        size = self.cost.chunk_size
        segments = []
        while start < end:
            boundary = (start // size + 1) * size
            rate = self.per_token_s + self.cost.attention_cost(boundary) / size
            segments.append((min(end, boundary) - start, rate))
            start = boundary
        return segments


@dataclass(frozen=True)
class PrefillBudget:
    """Prefill tokens a step may take beside its decodes (module doc), its estimate held to the
    device's measurements (`calibration`, told of every step by `observe`)."""

    model: StepTimeModel
    max_slowdown: float
    min_tokens: int
    calibration: StepCalibration = field(default_factory=StepCalibration, compare=False)

    def __post_init__(self) -> None:
        if self.max_slowdown < 1 or self.min_tokens < 1:
            raise ValueError("a prefill budget needs max_slowdown >= 1 and min_tokens >= 1")

    def allowance(self, decode_contexts: Sequence[int]) -> float:
        """The estimated prefill seconds a step with decodes at `decode_contexts` may add."""
        decode_s = self.model.decode_s(decode_contexts)
        return (self.max_slowdown - 1) * decode_s * self.calibration.scale

    def cap(self, decode_contexts: Sequence[int], start: int, at_most: int) -> int:
        """Prefill tokens (up to `at_most`) for a step with decodes at `decode_contexts`, its
        prefill starting at position `start`; `at_most` when nothing decodes."""
        if not decode_contexts:
            return at_most
        affordable = self.model.prefill_tokens_within(
            start, self.allowance(decode_contexts), at_most
        )
        return min(at_most, max(self.min_tokens, affordable))

    def observe(self, plan: StepPlan, measured_s: float) -> None:
        """The device spent `measured_s` on the step `plan` (0: not measured)."""
        decodes = [p.end for p in plan.pieces if p.end - p.start == 1]
        prefill_s = sum(
            self.model.prefill_s(p.start, p.end - p.start)
            for p in plan.pieces
            if p.end - p.start > 1
        )
        self.calibration.observe(self.model.decode_s(decodes), prefill_s, measured_s)


class StepPrefill:
    """The prefill one step being planned may still take: estimated seconds (the budget's
    allowance for the step's decodes), and a floor of `min_tokens` positions that keeps prompts
    moving however small the allowance is. Each piece is charged what it is estimated to cost
    at its own positions. A single-position piece (a decode) is never capped. Without a
    budget (`None`), or with nothing decoding, only the step's token budget applies.

    `contended`: more than one request wants prefill this step. A prefill that could use more
    than the allowance left then takes at most half of the step's allowance, or the floor if
    that is more, and is charged at most that half: the prompts behind a long one, the next
    turns of running sessions among them, keep the other half, and are not held back until it
    is done even where its floor alone costs more than the step's allowance."""

    def __init__(
        self,
        budget: PrefillBudget | None,
        decode_contexts: Sequence[int],
        contended: bool = False,
    ) -> None:
        self.budget = budget if decode_contexts else None
        self.decode_contexts = decode_contexts
        self.contended = contended
        self.cap: int | None = None  # the first prefill piece's cap (None: none, or uncapped)
        self._allowance = 0.0
        self._left_s: float | None = None  # None: no prefill piece yet
        self._floor_left = 0
        self._charged = False  # whether `took` counts against the budget (the last `limit`'s)
        self._halved = False  # whether the last `limit` held a long prefill to half of it

    def limit(self, pending: Sequence[tuple[int, int]], tokens_left: int) -> int:
        """Positions a request with these pending ranges may take now, of the `tokens_left`
        of the step's token budget; tell `took` what it took."""
        self._charged = self.budget is not None and not is_decode(pending)
        if not self._charged:
            return tokens_left
        budget = self.budget
        assert budget is not None
        start = pending[0][0]
        if self._left_s is None:
            self._allowance = budget.allowance(self.decode_contexts)
            self._left_s = self._allowance
            self._floor_left = budget.min_tokens
            self.cap = budget.cap(self.decode_contexts, start, tokens_left)
        wanted = min(tokens_left, sum(end - begin for begin, end in pending))
        seconds = max(self._left_s, 0.0)
        self._halved = self.contended and budget.model.prefill_s(start, wanted) > seconds
        if self._halved:
            seconds = min(seconds, self._allowance / 2)
        taken = budget.model.prefill_tokens_within(start, seconds, wanted)
        return max(taken, min(self._floor_left, wanted))

    def took(self, taken: Sequence[tuple[int, int]]) -> None:
        """The request last asked about (`limit`) took these positions."""
        if self._charged and self._left_s is not None:
            assert self.budget is not None
            model = self.budget.model
            cost = sum(model.prefill_s(start, end - start) for start, end in taken)
            self._left_s -= min(cost, self._allowance / 2) if self._halved else cost
            self._floor_left -= sum(end - start for start, end in taken)

    def has_room(self) -> bool:
        """Whether a prefill piece may still join the step."""
        return self._left_s is None or self._left_s > 0 or self._floor_left > 0


def is_decode(pending: Sequence[tuple[int, int]]) -> bool:
    """Whether pending positions are a single one: a decode, never capped."""
    return len(pending) == 1 and pending[0][1] - pending[0][0] == 1
