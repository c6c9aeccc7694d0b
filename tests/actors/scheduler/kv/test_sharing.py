"""Chunks shared by content: conversations with a common prefix use one copy of its full chunks.

The property test drives random interleavings of turns of conversations over shared prefixes
under tiny tiers, and after every step checks, beside the simulation's own checks (each chunk
reads back every user's content, the invariants, the event plane), that every eviction took the
chunk of lowest value at that moment, against a ranking computed from scratch.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.actors.config import Policy
from pensieve.actors.scheduler.kv.eviction import Candidate, EvictionOrder
from pensieve.actors.scheduler.kv.kv_cache import Chunk
from pensieve.actors.scheduler.kv.tier_moves import OutOfBlocks
from pensieve.actors.wire.chunk_keys import Namespace
from pensieve.actors.wire.messages import Tier
from tests.actors.scheduler.kv.test_kv_manager import BLOCK, Simulation

# conversation i: family i % 2, sharing its first 4 * (2 + i) tokens with the others of it
PREFIXES = {f"c{i}": (i % 2, BLOCK * (2 + i)) for i in range(6)}
SALTS = (Namespace(b""), Namespace(b"salted"))  # the namespaces chunks are keyed in


class CheckedOrder(EvictionOrder):
    """The manager's order, checked at every victim against all the chunks ranked afresh."""

    def _key(self, chunk: Chunk, now: float) -> tuple[float, float]:
        waiting = [u.waiting_since for u in chunk.users.values() if u.waiting_since is not None]
        return (math.inf, -min(waiting)) if waiting else (self.value(chunk, now), 0.0)

    def _lowest(self, tier: Tier, now: float, skip: set[int]) -> tuple[float, float] | None:
        chunks = {id(c): c for conv in self.conversations.values() for c in conv.chunks}
        keys = [
            self._key(c, now)
            for key, c in chunks.items()
            if key not in skip and not c.pins and self.on_tier(c, tier)
        ]
        return min(keys, default=None)

    def gpu_candidates(self, now: float) -> Any:
        yielded: set[int] = set()  # (a backed chunk may be passed over and stay)
        for candidate in super().gpu_candidates(now):
            assert (candidate.value, candidate.tie) == self._lowest(Tier.GPU, now, yielded)
            yielded.add(id(candidate.chunk))
            yield candidate

    def cpu_victim(self, incoming: Candidate | None, now: float, ahead: bool = False) -> Any:
        victim = super().cpu_victim(incoming, now, ahead)
        if victim is not None:
            assert self._key(victim, now) == self._lowest(Tier.CPU, now, set())
        return victim


def sharing_simulation(policy: Policy, num_gpu: int, num_cpu: int) -> Simulation:
    sim = Simulation(policy, num_gpu, num_cpu, PREFIXES)
    kv = sim.kv
    kv.eviction = CheckedOrder(
        kv.config, kv.cost, kv.conversations, kv.copies.reclaiming, kv.index.shared
    )
    return sim


def admit(sim: Simulation, name: str, tokens: int) -> bool:
    """A turn of `tokens` new tokens arrives: the cache is looked up by content, and the turn
    admitted if it fits."""
    kv = sim.kv
    conv = kv.conversation(name, sim.now)
    target = conv.num_positions + tokens
    log = sim.tokens(name, target)
    kv.lookup(conv, log[: target - 1])
    try:
        acquired = kv.acquire(conv, target, sim.now) if kv.can_admit(conv, target) else None
    except OutOfBlocks:
        acquired = None
    if acquired is None:
        return False
    sim.apply_orders()
    for start, end in acquired.recompute_ranges:
        sim.compute(name, start, end)
    sim.compute(name, conv.num_positions, target)
    return True


def step(sim: Simulation, op: str, which: int, tokens: int, gap: float) -> None:
    sim.now += gap
    kv, name = sim.kv, f"c{which}"
    if op in ("turn", "suspend", "admit") and name not in sim.running:
        if admit(sim, name, tokens):
            conv = kv.conversations[name]
            log = sim.tokens(name, conv.num_positions)
            if op == "turn":
                kv.release(conv, sim.now, log)
            elif op == "suspend":
                kv.suspend(conv, conv.num_positions, sim.now, log)
                kv.unwait(name)
            else:
                sim.running[name] = conv.num_positions
    elif op == "decode" and name in sim.running:
        conv = kv.conversations[name]
        if kv.grow(conv, conv.num_positions + 1, sim.now):
            sim.apply_orders()
            sim.compute(name, conv.num_positions, conv.num_positions + 1)
    elif op == "finish" and name in sim.running:
        del sim.running[name]
        conv = kv.conversations[name]
        kv.release(conv, sim.now, sim.tokens(name, conv.num_positions))
    elif op == "ahead":
        kv.swap_out_ahead(sim.now)
    elif op == "touch" and name not in sim.running:
        kv.touch(name, sim.now)
    elif op == "truncate" and name in kv.conversations and name not in sim.running:
        conv = kv.conversations[name]
        kept = max(conv.num_positions - tokens, 0)
        kv.truncate(conv, kept)
        sim.cut(name, kept)
    elif op == "forget" and name not in sim.running:
        kv.forget(name)
        sim.logs.pop(name, None)
    elif op == "rekey" and name in kv.conversations and name not in sim.running:
        kv.rekey(kv.conversations[name], SALTS[tokens % 2])  # a turn with(out) a cache salt
    sim.apply_orders()
    for running in sim.running:
        assert all(t is Tier.GPU for t in kv.conversations[running].tiers())
    for conv in kv.conversations.values():  # the keys the manager holds are its log's
        assert (
            conv.keys
            == conv.namespace.keys_of(sim.tokens(conv.conv_id, 0), BLOCK)[: len(conv.keys)]
        )
    sim.check()


OPS = ("turn", "turn", "turn", "suspend", "admit", "decode", "finish", "ahead", "touch")
workloads = st.lists(
    st.tuples(
        st.sampled_from((*OPS, "truncate", "forget", "rekey")),
        st.integers(0, 5),  # conversation
        st.integers(1, 24),  # tokens
        st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0, 40.0]),  # seconds since the last operation
    ),
    max_size=50,
)


@settings(max_examples=400, deadline=None)
@given(
    policy=st.sampled_from([Policy.PENSIEVE, Policy.LRU, Policy.GPU_ONLY]),
    num_gpu=st.integers(4, 24),
    num_cpu=st.integers(0, 10),
    workload=workloads,
)
def test_shared_chunks_are_never_lost_leaked_or_freed_while_used(
    policy, num_gpu, num_cpu, workload
):
    sim = sharing_simulation(policy, num_gpu, num_cpu)
    for op in workload:
        step(sim, *op)


def test_a_long_random_workload_shares_chunks():
    """The property test's workloads do share: a long one, checked after every step, holds
    shared chunks most of the time."""
    for policy in (Policy.PENSIEVE, Policy.LRU):
        rng = random.Random(7)
        sim = sharing_simulation(policy, num_gpu=24, num_cpu=10)
        shared_steps = 0
        for _ in range(600):
            op = rng.choice((*OPS, "truncate", "forget"))
            step(sim, op, rng.randrange(6), rng.randint(1, 24), rng.choice([0.5, 1.0, 10.0]))
            shared_steps += sim.kv.num_shared_chunks > 0
        assert shared_steps > 300, (policy, shared_steps)


def three_chunk_turn(sim: Simulation, name: str, t: float) -> None:
    sim.now = t
    assert admit(sim, name, 14)  # 3 full chunks and 2 tokens
    conv = sim.kv.conversations[name]
    sim.kv.release(conv, t, sim.tokens(name, conv.num_positions))
    sim.check()


def test_two_conversations_with_one_prefix_share_its_chunks():
    sim = sharing_simulation(Policy.PENSIEVE, num_gpu=12, num_cpu=8)
    sim.prefixes = {"a": (0, 12), "b": (0, 12)}  # the same first 3 chunks, then their own
    kv = sim.kv
    three_chunk_turn(sim, "a", 0.0)
    a = kv.conversations["a"]
    assert kv.gpu.num_free == 12 - 4
    b = kv.conversation("b", 1.0)
    found = kv.lookup(b, sim.tokens("b", 14)[:13])
    assert (found.num_positions, found.gpu_tokens, found.cpu_tokens) == (12, 12, 0)
    acquired = kv.acquire(b, 14, 1.0)
    assert (acquired.gpu_tokens, acquired.recompute_ranges) == (12, ())
    sim.apply_orders()
    sim.compute("b", 12, 14)
    kv.release(b, 1.0, sim.tokens("b", 14))
    sim.check()
    assert all(x is y for x, y in zip(a.chunks[:3], b.chunks[:3], strict=True))
    assert a.chunks[3] is not b.chunks[3]
    assert kv.gpu.num_free == 12 - 5  # 3 shared + 2 own
    assert kv.num_shared_chunks == 3
    # the shared chunks are worth both users' 1/T: more than b's own last chunk
    value = kv.eviction.value
    assert value(a.chunks[2], 10.0) > value(b.chunks[3], 10.0) > 0
    # evicting them moves each once, and both users see it; the idle conversations' own
    # chunks go first
    kv.config = replace(kv.config, swap_out_threshold=0.99)
    kv.swap_out_ahead(10.0)
    orders = sim.apply_orders()
    assert len({op.gpu_block for op in orders.swap_out}) == len(orders.swap_out) == 5
    own = {a.chunks[3].gpu_block, b.chunks[3].gpu_block}
    assert {op.gpu_block for op in orders.swap_out[:2]} == own
    assert [c.tier for c in a.chunks[:3]] == [Tier.GPU] * 3  # swapped out, not yet reclaimed
    assert all(c.cpu_slot is not None for c in a.chunks + b.chunks)
    events = [(e.kind.value, e.conversation_id, e.index) for e in kv.take_events()]
    assert events.count(("swapped_out", "a", 0)) == events.count(("swapped_out", "b", 0)) == 1
    sim.last_events = []
    sim.tier_map.apply(sim.stream.batch([]))  # (the events were taken above)
    kv.forget("a")
    assert all(c.cpu_slot is not None for c in b.chunks[:3])  # b keeps them
    assert kv.num_shared_chunks == 0
    assert list(b.chunks[0].users) == ["b"]
    kv.forget("b")
    assert kv.cpu.num_free == 8 and kv.num_free_gpu == 12 and not kv.index.by_key


def test_a_dropped_shared_chunk_recomputed_by_one_user_serves_all():
    sim = sharing_simulation(Policy.GPU_ONLY, num_gpu=8, num_cpu=0)
    sim.prefixes = {"a": (0, 12), "b": (0, 12), "big": (1, 0)}
    kv = sim.kv
    three_chunk_turn(sim, "a", 0.0)
    three_chunk_turn(sim, "b", 1.0)
    assert kv.num_shared_chunks == 3 and kv.gpu.num_free == 8 - 5
    sim.now = 50.0
    big = kv.conversation("big", 50.0)
    kv.acquire(big, 32, 50.0)  # all 8 blocks: everything idle is dropped
    sim.apply_orders()
    sim.compute("big", 0, 32)
    kv.release(big, 50.0, sim.tokens("big", 32))
    kv.forget("big")
    sim.check()
    a, b = kv.conversations["a"], kv.conversations["b"]
    assert a.tiers()[:3] == b.tiers()[:3] == [Tier.DROPPED] * 3
    sim.now = 60.0
    found = kv.lookup(a, sim.tokens("a", 15)[:14])
    assert found.num_positions == 0  # nothing cached
    acquired = kv.acquire(a, 15, 60.0)
    assert acquired.recompute_ranges == ((0, 14),)
    sim.apply_orders()
    for start, end in acquired.recompute_ranges:
        sim.compute("a", start, end)
    sim.compute("a", 14, 15)
    assert b.tiers()[:3] == [Tier.DROPPED] * 3  # a recomputes chunks of its own meanwhile
    kv.release(a, 61.0, sim.tokens("a", 15))
    sim.check()
    assert all(x is y for x, y in zip(a.chunks[:3], b.chunks[:3], strict=True))
    assert b.tiers()[:3] == [Tier.GPU] * 3
    acquired = kv.acquire(b, 15, 62.0)  # only b's own chunk is recomputed
    assert (acquired.gpu_tokens, acquired.recompute_ranges) == (12, ((12, 14),))
    sim.apply_orders()
    sim.compute("b", 12, 15)
    sim.check()


def test_a_rekeyed_conversation_tells_the_event_plane_it_names_its_keys_no_more():
    """Its dropped chunks sealed under the old namespace become chunks of its own: a router's
    prefix index stops counting it among the holders of those keys (else the keys would outlive
    their other users there)."""
    sim = sharing_simulation(Policy.GPU_ONLY, num_gpu=8, num_cpu=0)
    sim.prefixes = {"a": (0, 12), "b": (0, 12), "big": (1, 0)}
    kv = sim.kv
    three_chunk_turn(sim, "a", 0.0)
    three_chunk_turn(sim, "b", 1.0)
    big = kv.conversation("big", 50.0)
    kv.acquire(big, 32, 50.0)  # all 8 blocks: everything idle is dropped
    kv.release(big, 50.0)
    kv.forget("big")
    sim.check()
    a = kv.conversations["a"]
    assert a.tiers()[:3] == [Tier.DROPPED] * 3 and a.chunks[0].key is not None
    kv.rekey(a, SALTS[1])
    sim.check()  # the prefix index names a's chunks as the manager does: unsealed
    assert sim.router.snapshot("sim")["a"][:3] == (None, None, None)
