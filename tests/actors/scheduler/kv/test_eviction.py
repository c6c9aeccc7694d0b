"""The eviction order within one pass: every victim is the lowest-ranked chunk at that moment.

A pass (an admission, a growth, a suspension, an ahead-of-time swap-out) may evict many chunks,
and each move changes what the next victim should be: a chunk swapped out earlier in the pass is
on the CPU tier now, and may be worth less than the next one to place there. The reference here
ranks the CPU tier afresh for every victim; the manager's one ranking per pass must agree with it.
"""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pensieve.actors.config import Policy
from pensieve.actors.scheduler.kv.eviction import EvictionOrder
from pensieve.actors.scheduler.kv.tier_moves import OutOfBlocks
from pensieve.actors.wire.messages import KvEvent, Tier
from tests.actors.scheduler.kv.test_kv_manager import Simulation, snapshot


class RankedForEachVictim(EvictionOrder):
    """The reference: the CPU tier ranked afresh, from the chunks' places now, for each victim."""

    def cpu_victim(self, *args: Any, **kwargs: Any) -> Any:
        self.start_operation()
        return super().cpu_victim(*args, **kwargs)


def reference(sim: Simulation) -> Simulation:
    kv = sim.kv
    kv.eviction = RankedForEachVictim(kv.config, kv.cost, kv.conversations, kv.copies.reclaiming)
    return sim


def moves(events: list[KvEvent]) -> list[tuple[str, str, int]]:
    return [(e.kind.value, e.conversation_id, e.index) for e in events]


def turn(sim: Simulation, name: str, num_positions: int, t: float, suspend: bool = False) -> None:
    """A turn of `name` up to `num_positions`; it ends, or is suspended and leaves the queue."""
    kv = sim.kv
    conv = kv.conversation(name, t)
    kv.acquire(conv, num_positions, t)
    sim.apply_orders()
    sim.compute(name, conv.num_positions, num_positions)
    if suspend:
        kv.suspend(conv, num_positions, t)
        kv.unwait(name)
    else:
        kv.release(conv, t)
    sim.apply_orders()
    sim.check()


def three_chunks_between_cold_and_warm(sim: Simulation) -> None:
    """CPU (3 slots): cold's chunk, worth less than any of x's, and warm's two, worth more.
    GPU: x's three chunks, three blocks free."""
    turn(sim, "cold", 4, 0.0, suspend=True)
    turn(sim, "x", 12, 10.0)
    turn(sim, "warm", 8, 50.0, suspend=True)
    kv = sim.kv
    tiers = {name: kv.conversations[name].tiers() for name in ("cold", "x", "warm")}
    assert tiers == {"cold": [Tier.CPU], "x": [Tier.GPU] * 3, "warm": [Tier.CPU] * 2}


def test_one_pass_evicts_in_the_order_of_a_pass_ranked_afresh_for_each_victim():
    """An admission that evicts x's three chunks on demand: x's chunk 0 takes cold's slot, and
    then, being worth less than x's chunk 1, it is the next to be dropped, not a hole after it."""
    passes = []
    for sim in (Simulation(Policy.PENSIEVE, 6, 3), reference(Simulation(Policy.PENSIEVE, 6, 3))):
        three_chunks_between_cold_and_warm(sim)
        kv = sim.kv
        kv.acquire(kv.conversation("big", 100.0), 24, 100.0)  # 6 blocks: x's three go
        sim.apply_orders()
        sim.check()
        passes.append(moves(sim.last_events))
        x = kv.conversations["x"]
        assert x.tiers() == [Tier.DROPPED, Tier.DROPPED, Tier.CPU]
        kv.release(kv.conversations["big"], 101.0)
        acquired = kv.acquire(x, 13, 102.0)  # x's next turn recomputes a leading range only
        assert (acquired.recompute_ranges, acquired.swapped_in) == (((0, 8),), 1)
    assert passes[0] == passes[1]
    assert passes[0][:6] == [
        ("dropped", "cold", 0),
        ("swapped_out", "x", 0),
        ("dropped", "x", 0),
        ("swapped_out", "x", 1),
        ("dropped", "x", 1),
        ("swapped_out", "x", 2),
    ]


def test_a_suspended_turn_gives_up_its_own_leading_chunks_first():
    """Suspension pushes every chunk off the GPU, dropping whatever the CPU tier ranks lowest:
    with one slot, each chunk takes the place of the one before it."""
    for sim in (Simulation(Policy.PENSIEVE, 4, 1), reference(Simulation(Policy.PENSIEVE, 4, 1))):
        turn(sim, "a", 1, 0.0, suspend=True)
        turn(sim, "b", 12, 0.0, suspend=True)
        assert sim.kv.conversations["b"].tiers() == [Tier.DROPPED, Tier.DROPPED, Tier.CPU]
        assert sim.kv.conversations["a"].tiers() == [Tier.DROPPED]


# turns that end or are suspended come twice as often: they are what fills and evicts
OPS = ("turn", "turn", "suspend", "suspend", "admit", "decode", "finish", "ahead", "touch")
workloads = st.lists(
    st.tuples(
        st.sampled_from((*OPS, "truncate")),
        st.integers(0, 5),  # conversation
        st.integers(1, 24),  # tokens
        st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0, 40.0]),  # seconds since the last operation
    ),
    max_size=50,
)


def step(sim: Simulation, op: str, which: int, tokens: int, gap: float) -> None:
    """One operation of a workload, then the step's copies and the checks (the invariants,
    and that every conversation is evicted from its leading end)."""
    sim.now += gap
    kv, name = sim.kv, f"c{which}"
    if op in ("turn", "suspend", "admit") and name not in sim.running:
        conv = kv.conversation(name, sim.now)
        target = conv.num_positions + tokens
        try:
            acquired = kv.acquire(conv, target, sim.now) if kv.can_admit(conv, target) else None
        except OutOfBlocks:
            acquired = None
        if acquired is not None:
            sim.apply_orders()
            for start, end in acquired.recompute_ranges:
                sim.compute(name, start, end)
            sim.compute(name, conv.num_positions, target)
            if op == "turn":
                kv.release(conv, sim.now)
            elif op == "suspend":
                kv.suspend(conv, target, sim.now)
                if tokens % 2:  # rejected, or still queued
                    kv.unwait(name)
            else:
                sim.running[name] = target
    elif op == "decode" and name in sim.running:
        conv = kv.conversations[name]
        if kv.grow(conv, conv.num_positions + 1, sim.now):
            sim.apply_orders()
            sim.compute(name, conv.num_positions, conv.num_positions + 1)
    elif op == "finish" and name in sim.running:
        del sim.running[name]
        kv.release(kv.conversations[name], sim.now)
    elif op == "ahead":
        kv.swap_out_ahead(sim.now)
    elif op == "touch" and name not in sim.running:
        kv.touch(name, sim.now)
    elif op == "truncate" and name in kv.conversations and name not in sim.running:
        conv = kv.conversations[name]
        kv.truncate(conv, max(conv.num_positions - tokens, 0))
    sim.apply_orders()
    sim.check()


@settings(max_examples=500, deadline=None)
@given(
    policy=st.sampled_from([Policy.PENSIEVE, Policy.LRU]),
    num_gpu=st.integers(4, 16),
    num_cpu=st.integers(1, 8),
    workload=workloads,
)
@example(  # all worth as much (lru, one time): the evicted chunk's own earlier one goes first
    policy=Policy.LRU,
    num_gpu=7,
    num_cpu=3,
    workload=[("turn", 0, 1, 0.0), ("turn", 0, 3, 0.0), ("turn", 0, 5, 0.0)]
    + [("turn", 1, 21, 0.0), ("turn", 2, 5, 0.0)],
)
def test_every_pass_evicts_from_the_leading_end(policy, num_gpu, num_cpu, workload):
    """After every pass, whatever the workload, no conversation holds a dropped chunk after a
    kept one of its own, nor a chunk on a lower tier than an earlier one (`Simulation.check`;
    the other policies, with one tier, are checked the same way by `test_kv_manager`)."""
    sim = Simulation(policy, num_gpu, num_cpu)
    for op in workload:
        step(sim, *op)


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from([Policy.PENSIEVE, Policy.LRU]),
    num_gpu=st.integers(4, 16),
    num_cpu=st.integers(1, 8),
    workload=workloads,
)
def test_every_pass_moves_what_a_pass_ranked_afresh_for_each_victim_moves(
    policy, num_gpu, num_cpu, workload
):
    sim, ref = Simulation(policy, num_gpu, num_cpu), reference(Simulation(policy, num_gpu, num_cpu))
    for op in workload:
        step(sim, *op)
        step(ref, *op)
        assert moves(sim.last_events) == moves(ref.last_events)
        assert snapshot(sim.kv) == snapshot(ref.kv)
