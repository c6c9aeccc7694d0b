"""The decode-aware prefill budget: its step-time model, and the real scheduler and cache manager
planning a long prompt beside running decodes (no model: sampled tokens are made up, as the
scheduler never looks at their values)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pensieve.actors.config import CacheConfig, SchedulerConfig
from pensieve.actors.scheduler.kv.cost_model import CostModel
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.scheduler.request import Request
from pensieve.actors.scheduler.scheduler import Scheduler
from pensieve.actors.scheduler.step_budget import PrefillBudget, StepTimeModel
from tests.actors.scheduler.test_scheduler import Driver as SchedulerDriver

BLOCK = 32
# per chunk of 32: 0.32 ms outside attention (10 us a token), attention 0.1 ms at 32 positions
# growing to 4 ms at 32k; 2 ms read once per step
COST = CostModel((32, 1024, 32768), (1e-4, 2e-4, 4e-3), 3.2e-4, BLOCK)
MODEL = StepTimeModel(COST, fixed_s=2e-3)
TOKENS = 2048  # the step's token budget


def test_the_model_adds_the_fixed_cost_tokens_and_attention_by_context() -> None:
    # two decodes at 32 and 1024 positions: F + 2 tokens + A(32) + A(1024)
    assert MODEL.decode_s([32, 1024]) == pytest.approx(2e-3 + 2e-5 + 1e-4 + 2e-4)
    # 40 positions from 16: the last half of the chunk ending at 32, 24 of the one ending at 64
    # (each pays its share of its whole chunk's attention)
    first = 16 * (1e-5 + COST.attention_cost(32) / 32)
    second = 24 * (1e-5 + COST.attention_cost(64) / 32)
    assert MODEL.prefill_s(16, 40) == pytest.approx(first + second)


@given(
    start=st.integers(0, 40_000),
    seconds=st.floats(0, 0.1, allow_nan=False),
    at_most=st.integers(1, 4096),
)
def test_the_tokens_within_a_time_are_the_most_that_fit(
    start: int, seconds: float, at_most: int
) -> None:
    n = MODEL.prefill_tokens_within(start, seconds, at_most)
    assert 0 <= n <= at_most
    assert MODEL.prefill_s(start, n) <= seconds * (1 + 1e-9)
    if n < at_most:
        assert MODEL.prefill_s(start, n + 1) > seconds


class Driver(SchedulerDriver):
    """A scheduler with `num_decodes` sessions decoding, planning one step at a time."""

    def __init__(self, slowdown: float | None, min_tokens: int = BLOCK) -> None:
        kv = KVCacheManager(CacheConfig(BLOCK, 4096, 0), cost=COST.cost)
        config = SchedulerConfig(
            TOKENS, 64, 65536, max_step_slowdown=slowdown, min_prefill_tokens=min_tokens
        )
        self.scheduler = Scheduler(config, kv, MODEL)
        self.budget = PrefillBudget(MODEL, slowdown or 1.0, min_tokens)
        self.count = 0
        self.now = 0.0


def _long_prompt_beside(d: Driver, num_decodes: int, prompt_len: int) -> tuple[list, Request]:
    sessions = [d.send(100 + 50 * i, max_tokens=10_000) for i in range(num_decodes)]
    d.step()  # their prompts
    d.step()  # their first decodes
    return sessions, d.send(prompt_len, max_tokens=3)


def test_beside_decodes_each_step_takes_the_prefill_the_model_allows() -> None:
    d = Driver(slowdown=2.0)
    sessions, long = _long_prompt_beside(d, num_decodes=8, prompt_len=20_000)
    caps = []
    while long.first_token_time is None:
        decodes = [s.num_tokens for s in sessions]  # each attends to all of its positions
        start = long.first_pending if long.pending else 0
        plan = d.step()
        pieces = {p.request_id: p for p in plan.pieces}
        # every session decodes in every step, and the prompt moves on in every step
        assert all(pieces[s.request_id].end - pieces[s.request_id].start == 1 for s in sessions)
        piece = pieces[long.request_id]
        assert piece.start == start
        cap = d.budget.cap(decodes, start, TOKENS - len(sessions))
        assert plan.prefill_cap == cap
        assert piece.end - piece.start == min(cap, 20_000 - start)
        # within twice the decode-only estimate, or at the floor
        decode_s = MODEL.decode_s(decodes)
        assert cap == BLOCK or decode_s + MODEL.prefill_s(start, cap) <= 2 * decode_s * 1.000001
        caps.append(cap)
    # the cap shrinks as the prompt's attention grows, and never below one block
    assert caps[0] > caps[-1] >= BLOCK
    assert caps[0] < TOKENS // 4


def test_a_slowdown_of_one_leaves_the_floor_each_step() -> None:
    d = Driver(slowdown=1.0, min_tokens=64)
    _, long = _long_prompt_beside(d, num_decodes=4, prompt_len=1000)
    sizes = []
    while long.first_token_time is None:
        piece = next(p for p in d.step().pieces if p.request_id == long.request_id)
        sizes.append(piece.end - piece.start)
    assert sizes == [64] * 15 + [1000 - 15 * 64]


def test_with_nothing_decoding_a_prompt_takes_the_whole_token_budget() -> None:
    d = Driver(slowdown=2.0)
    long = d.send(5000, max_tokens=3)
    plans = [d.step() for _ in range(3)]
    assert [p.num_tokens for p in plans] == [TOKENS, TOKENS, 5000 - 2 * TOKENS]
    assert long.first_token_time is not None
    assert all(p.prefill_cap is None for p in plans)


def test_prefill_past_the_cap_waits_for_the_next_step() -> None:
    # two prompts arrive beside the decodes: the second one gets only what the first leaves
    d = Driver(slowdown=1.0, min_tokens=96)
    sessions, first = _long_prompt_beside(d, num_decodes=2, prompt_len=64)
    second = d.send(500, max_tokens=3)
    plan = d.step()
    sizes = {p.request_id: p.end - p.start for p in plan.pieces}
    assert sizes == {**{s.request_id: 1 for s in sessions}, first.request_id: 64,
                     second.request_id: 32}  # fmt: skip
    plan = d.step()
    assert max(p.end - p.start for p in plan.pieces) == 96


def test_off_a_prompt_beside_decodes_takes_what_the_token_budget_leaves() -> None:
    d = Driver(slowdown=None)
    sessions, long = _long_prompt_beside(d, num_decodes=8, prompt_len=5000)
    plan = d.step()
    piece = next(p for p in plan.pieces if p.request_id == long.request_id)
    assert piece.end - piece.start == TOKENS - len(sessions)
    assert plan.prefill_cap is None


def test_a_slowdown_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_step_slowdown"):
        SchedulerConfig(max_step_slowdown=0.5)


def test_a_prefill_measured_slower_than_its_estimate_gets_fewer_tokens() -> None:
    d = Driver(slowdown=2.0)
    sessions, long = _long_prompt_beside(d, num_decodes=8, prompt_len=20_000)
    decodes = [s.num_tokens for s in sessions]
    before = d.scheduler.prefill_budget.cap(decodes, 0, TOKENS)  # type: ignore[union-attr]
    plan = d.step()  # the first piece of the prompt beside the decodes
    budget = d.scheduler.prefill_budget
    assert budget is not None
    piece = next(p for p in plan.pieces if p.request_id == long.request_id)
    estimate = MODEL.prefill_s(piece.start, piece.end - piece.start)
    decode_s = MODEL.decode_s([p.end for p in plan.pieces if p.end - p.start == 1])
    for _ in range(30):  # the device reports decodes as estimated, the prefill 4x slower
        budget.observe(plan, decode_s + 4 * estimate)
    assert budget.calibration.prefill == pytest.approx(4.0)
    after = budget.cap(decodes, 0, TOKENS)
    assert after < before / 3
    plan = d.step()
    piece = next(p for p in plan.pieces if p.request_id == long.request_id)
    decode_s = MODEL.decode_s([p.end for p in plan.pieces if p.end - p.start == 1])
    # within twice the decodes' time as measured, or at the floor
    assert (
        piece.end - piece.start == BLOCK
        or 4 * MODEL.prefill_s(piece.start, piece.end - piece.start) <= decode_s * 1.000001
    )


def test_a_short_prompt_is_not_held_behind_a_long_one() -> None:
    # a session's next turn arrives while a long prompt is being prefilled beside the decodes:
    # it is prefilled in the next step, with the long prompt still going
    d = Driver(slowdown=2.0)
    sessions, long = _long_prompt_beside(d, num_decodes=8, prompt_len=20_000)
    for _ in range(3):
        d.step()
    short = d.send(200, max_tokens=3)
    for _ in range(3):
        d.step()
    assert short.first_token_time is not None
    assert long.first_token_time is None
    # and the long prompt kept moving in every one of those steps
    assert long.first_pending > 0


def test_a_long_prompt_at_its_floor_leaves_room_for_a_short_one() -> None:
    # deep into a long prompt its floor alone costs more than a step's allowance: a session's
    # next turn still gets the half of the allowance a long prompt leaves, and starts long
    # before the long prompt ends
    d = Driver(slowdown=1.2, min_tokens=64)
    _, long = _long_prompt_beside(d, num_decodes=4, prompt_len=20_000)
    d.step()
    while long.first_pending < 10_000:
        d.step()
    short = d.send(200, max_tokens=3)
    for _ in range(40):
        plan = d.step()
        piece = next(p for p in plan.pieces if p.request_id == long.request_id)
        assert piece.end - piece.start == 64  # the long prompt keeps moving at its floor
        if short.first_token_time is not None:
            break
    assert short.first_token_time is not None
    assert long.first_token_time is None
