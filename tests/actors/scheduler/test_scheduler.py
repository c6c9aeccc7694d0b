"""The scheduler's admission grouping, on the real scheduler and cache manager (no model: sampled
tokens are made up, as the scheduler never looks at their values)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.actors.config import CacheConfig, SchedulerConfig
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.scheduler.request import Request, RequestStatus
from pensieve.actors.scheduler.scheduler import Scheduler
from pensieve.actors.wire.step import PLACEHOLDER, SamplingParams, StepPlan
from pensieve.actors.wire.structured import Grammar

SEQS = 16  # admit group: min(admit_batch, 16 // 8) = 2 with the default admit_batch


class Driver:
    def __init__(self, admit_batch: int = 8, budget: int = 512) -> None:
        kv = KVCacheManager(CacheConfig(4, 4096, 0), cost=lambda context: 1.0)
        self.scheduler = Scheduler(SchedulerConfig(budget, SEQS, 4096, admit_batch), kv)
        self.count = 0
        self.now = 0.0

    def send(self, prompt_len: int, max_tokens: int) -> Request:
        self.count += 1
        request = Request(
            f"r{self.count}",
            f"c{self.count}",
            list(range(3, 3 + prompt_len)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            self.now,
        )
        self.scheduler.add(request)
        return request

    def step(self) -> StepPlan:
        self.now += 0.01
        plan = self.scheduler.schedule(self.now)
        sampled = [7 for piece in plan.pieces if piece.sampling is not None]
        self.scheduler.update(plan, sampled, self.now)
        return plan


def admitted(plan: StepPlan, requests: list[Request]) -> set[str]:
    ids = {r.request_id for r in requests}
    return {p.request_id for p in plan.pieces if p.request_id in ids and p.end - p.start > 1}


def test_at_the_cap_a_decode_step_waits_for_a_group_of_free_slots() -> None:
    d = Driver()
    assert d.scheduler.config.admit_group == 2
    # a full running set that finishes one request per step from step 3 on (staggered lengths)
    for i in range(SEQS):
        d.send(8, max_tokens=3 + i)
    d.step()  # all prefill together
    queued = [d.send(8, max_tokens=50) for _ in range(6)]
    plans = [d.step() for _ in range(6)]
    # one slot frees per step; each step that would only decode admits once two slots are free
    starts = [admitted(plan, queued) for plan in plans]
    counts = [len(s) for s in starts]
    assert counts[:2] == [0, 0]  # nothing finished yet / one slot free: decode only
    assert all(c in (0, 2) for c in counts), counts  # admissions come in pairs
    assert sum(counts) >= 4
    assert all(
        all(p.end - p.start == 1 for p in plan.pieces)
        for plan, c in zip(plans, counts, strict=True)
        if c == 0
    )


def test_admit_batch_one_admits_each_slot_at_once() -> None:
    d = Driver(admit_batch=1)
    for i in range(SEQS):
        d.send(8, max_tokens=3 + i)
    d.step()
    queued = [d.send(8, max_tokens=50) for _ in range(6)]
    counts = [len(admitted(d.step(), queued)) for _ in range(6)]
    assert counts[0] == 0 and all(c == 1 for c in counts[2:6]), counts


def test_a_lone_waiting_request_and_an_idle_engine_are_not_held_back() -> None:
    d = Driver()
    first = d.send(8, max_tokens=20)
    assert admitted(d.step(), [first]) == {first.request_id}  # nothing runs: admit at once
    late = d.send(8, max_tokens=5)
    assert admitted(d.step(), [late]) == {late.request_id}  # one waits, slots free: at once


def test_a_step_with_prefill_work_admits_into_a_single_free_slot() -> None:
    d = Driver(budget=64)
    for i in range(SEQS - 1):
        d.send(8, max_tokens=30 + i)
    while d.scheduler.waiting or any(
        r.pending and r.pending[0][1] - r.pending[0][0] > 1 for r in d.scheduler.running
    ):
        d.step()  # until all 15 decode
    long_prompt = d.send(60, max_tokens=30)  # 15 decodes leave 49 of the budget: two steps
    d.step()
    assert long_prompt.pending  # its last 11 positions still to compute
    # the running set is full; free one slot by stopping a decoding request
    stopped = d.scheduler.running[0]
    assert d.scheduler.stop_at(stopped, len(stopped.output_ids), d.now)
    queued = [d.send(8, max_tokens=5), d.send(8, max_tokens=5)]
    plan = d.step()  # has a multi-token piece anyway: admits into the one free slot
    assert admitted(plan, queued) == {queued[0].request_id}


def test_a_turn_that_arrives_makes_its_conversation_active_again() -> None:
    """The scheduler tells the cache a turn arrived (the conversation's idle time restarts), so
    its history is not ranked for eviction as if its user were still thinking."""
    driver = Driver()
    first = driver.send(20, 2)
    while first.status is not RequestStatus.FINISHED:
        driver.step()
    conv = driver.scheduler.kv.conversations[first.conv_id]
    ended = conv.last_active
    driver.now = ended + 30.0
    again = Request("r-again", first.conv_id, first.all_ids + [5, 6], first.sampling, driver.now)
    driver.scheduler.add(again)
    assert conv.last_active == ended + 30.0


def test_admit_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="admit_batch"):
        SchedulerConfig(admit_batch=0)


# ---- planning a step ahead (the engine's overlap) --------------------------------------------

EOS = 2


def model_token(conv_id: str, position: int, fed: int) -> int:
    """A deterministic stand-in for the model: the token after `position` depends on the token
    fed there, so a wrong or missing feed changes every later token. EOS now and then."""
    value = (hash(conv_id) % 997 + 31 * position + 7 * fed) % 50
    return EOS if value == 0 else 3 + value


def run_pipelined(requests: list[tuple[int, int]], depth: int, gpu_blocks: int) -> dict:
    """Serve `requests` (prompt length, max_tokens) with `depth` steps in flight (1: plan after
    applying; 2: plan step N+1 before applying step N, feeding its decodes step N's tokens as
    the executor does). Returns every request's output and checks the accounting each step."""
    kv = KVCacheManager(CacheConfig(4, gpu_blocks, 64), cost=lambda context: 1.0 + context)
    scheduler = Scheduler(SchedulerConfig(24, 6, 4096, 1), kv)
    made = []
    for i, (prompt_len, max_tokens) in enumerate(requests):
        prompt = [3 + (i * 5 + j) % 40 for j in range(prompt_len)]
        request = Request(
            f"r{i}",
            f"c{i}",
            prompt,
            SamplingParams(max_tokens=max_tokens),
            float(i),
            eos_token_ids=frozenset({EOS}),
        )
        scheduler.add(request)
        made.append(request)
    inflight: list[tuple[StepPlan, list[int]]] = []
    now, placeholders = 0.0, 0
    previous: dict[str, int] = {}  # request id -> token sampled by the step launched last
    while scheduler.has_work() or inflight:
        now += 1.0
        plan = scheduler.schedule(now)
        sampled, fed = [], {}
        for piece in plan.pieces:
            tokens = list(piece.token_ids)
            if tokens[-1] == PLACEHOLDER:
                assert piece.end - piece.start == 1 and depth == 2
                tokens[-1] = previous[piece.request_id]  # what the executor's feed does
                placeholders += 1
            assert PLACEHOLDER not in tokens
            if piece.sampling is not None:
                token = model_token(piece.request_id, piece.end - 1, tokens[-1])
                sampled.append(token)
                fed[piece.request_id] = token
        previous = fed
        if plan.pieces:  # as in the engine, a step that samples nothing is not waited for
            inflight.append((plan, sampled))
        if inflight and (len(inflight) == depth or not plan.pieces):
            done, tokens = inflight.pop(0)
            scheduler.update(done, tokens, now)
            kv.swap_out_ahead(now)
        kv.take_orders()
        kv.check_invariants()
        for request in scheduler.running:
            assert all(c.gpu_block is not None for c in kv.conversations[request.conv_id].chunks)
    assert all(r.status is RequestStatus.FINISHED and not r.inflight for r in made)
    for r in made:  # a turn's prompt positions by source add up to its prompt, suspended or not
        s = r.sources
        assert s.gpu + s.cpu + s.recomputed + s.new == len(r.prompt_ids), (r.request_id, s)
    return {r.request_id: (r.output_ids, r.finish_reason, placeholders > 0) for r in made}


@settings(max_examples=200, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=10),
    gpu_blocks=st.integers(12, 40),
)
def test_planning_a_step_ahead_gives_the_same_tokens(requests, gpu_blocks) -> None:
    """Tokens, finish reasons and block accounting do not depend on whether a step is planned
    before the one in flight is applied: turns that end on EOS with a decode already planned,
    suspensions with a token in flight, and requests that finish by length all included."""
    sync = run_pipelined(requests, depth=1, gpu_blocks=gpu_blocks)
    ahead = run_pipelined(requests, depth=2, gpu_blocks=gpu_blocks)
    assert {k: v[:2] for k, v in ahead.items()} == {k: v[:2] for k, v in sync.items()}
    if any(max_tokens > 2 for _, max_tokens in requests):
        assert all(v[2] for v in ahead.values())  # decodes were fed from the step in flight


def test_a_constrained_request_sends_its_output_when_none_of_its_tokens_is_in_flight() -> None:
    kv = KVCacheManager(CacheConfig(4, 4096, 0), cost=lambda context: 1.0)
    scheduler = Scheduler(SchedulerConfig(512, SEQS, 4096, 8), kv)
    constrained = SamplingParams(max_tokens=8, ignore_eos=True, grammar=Grammar("regex", "a+"))
    scheduler.add(Request("r", "c", [3, 4, 5], constrained, 0.0))
    scheduler.add(Request("f", "d", [3, 4, 6], SamplingParams(max_tokens=8), 0.0))
    first = scheduler.schedule(0.01)  # the prompts: their first samples, nothing in flight
    second = scheduler.schedule(0.02)  # planned ahead: the first samples are in flight
    assert [p.output_ids for p in first.pieces] == [(), None]
    assert [p.output_ids for p in second.pieces] == [None, None]
    scheduler.update(first, [7, 7], 0.03)
    scheduler.update(second, [8, 8], 0.04)
    third = scheduler.schedule(0.05)  # the engine applied both: the output so far goes along
    assert [p.output_ids for p in third.pieces] == [(7, 8), None]


def test_a_turn_suspended_with_a_piece_in_flight_waits_for_it_before_coming_back() -> None:
    """With steps planned ahead, a turn can be suspended (a running turn's growth found the
    GPU full) while its last prefill piece is still computing. Readmitted in that same plan, it
    would cut its KV back to the positions counted so far and free the blocks the piece writes
    into; the piece, applied after, would then count positions that no chunk holds."""
    kv = KVCacheManager(CacheConfig(4, 64, 64), cost=lambda context: 1.0 + context)
    scheduler = Scheduler(SchedulerConfig(16, SEQS, 4096, 1), kv)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    request = Request("r", "c", list(range(3, 43)), sampling, 0.0)
    scheduler.add(request)
    first = scheduler.schedule(0.01)  # the first 16 of its 40 prompt positions
    assert [(p.start, p.end) for p in first.pieces] == [(0, 16)]
    scheduler._suspend(request, 0.02)  # as a grow that finds the GPU full does
    second = scheduler.schedule(0.03)  # planned while `first` computes
    assert second.pieces == ()  # it waits for its piece in flight
    scheduler.update(first, [], 0.04)
    kv.take_orders()
    kv.check_invariants()
    third = scheduler.schedule(0.05)  # back, reusing the 16 positions it computed
    assert [(p.start, p.end) for p in third.pieces] == [(16, 32)]
    kv.check_invariants()
