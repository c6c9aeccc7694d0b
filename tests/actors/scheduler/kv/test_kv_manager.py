"""Property tests of the block-accounting core, with a simulated memory that checks the copies.

Each chunk's content is modelled as a tag: the tokens before it and the tokens it holds, from its
conversation's token log. The test applies the manager's swap orders in the executor's order to
simulated GPU and CPU memories, and checks that every chunk reads back, in every conversation
that uses it, that conversation's tag from wherever the manager says it lives. Every check also
rebuilds the tier map, the spill index and a router's prefix index from the manager's chunk
events alone, and compares them with the manager's own (the prefix index: every sealed key on a
tier, and where; each event's key chained to its parent by the conversation's tokens).
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.executor.spill_keeper import SpillChanges, SpillIndex
from pensieve.actors.planner.tier_map import TierMap, TierSnapshot
from pensieve.actors.scheduler.kv.kv_cache import Chunk
from pensieve.actors.scheduler.kv.kv_events import KvEventStream
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.scheduler.kv.tier_moves import OutOfBlocks
from pensieve.actors.wire.chunk_keys import chunk_key
from pensieve.actors.wire.messages import KvEvent, Tier
from pensieve.actors.wire.prefix_index import PrefixIndex
from pensieve.actors.wire.step import SwapOrders

BLOCK = 4


def snapshot(kv: KVCacheManager) -> TierSnapshot:
    """The cache manager's own map, in `TierMap.snapshot`'s form (to compare the two)."""
    return {
        conv.conv_id: tuple((chunk.gpu_block, chunk.cpu_slot) for chunk in conv.chunks)
        for conv in kv.conversations.values()
        if conv.chunks
    }


def place(kv: KVCacheManager, chunk: Chunk) -> int:
    """0 dropped, 1 on the CPU tier (its GPU block, if any, waits for reuse), 2 live on the GPU."""
    if chunk.gpu_block is not None and not kv._reclaiming(chunk):
        return 2
    return 1 if chunk.cpu_slot is not None else 0


def assert_evicted_from_the_leading_end(kv: KVCacheManager) -> None:
    """Within an idle conversation values grow with the chunk index, so what is dropped is a
    leading run, and no chunk is on a lower tier than an earlier chunk of its own."""
    for conv in kv.conversations.values():
        if conv.pinned:
            continue
        computed = conv.chunks[: -(-conv.num_positions // BLOCK)]
        places = [place(kv, chunk) for chunk in computed]
        assert places == sorted(places), f"{conv.conv_id}: tiers {places} out of rank"


class Simulation:
    """`prefixes`: conversation -> (family, length): its first `length` tokens are those of its
    family (conversations of one family share them); the others are its own. A truncated
    conversation's positions from there on get new tokens."""

    def __init__(
        self,
        policy: Policy,
        num_gpu: int,
        num_cpu: int,
        prefixes: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        config = CacheConfig(BLOCK, num_gpu, num_cpu, policy)
        self.kv = KVCacheManager(config, cost=lambda context: 1.0 + context / 100)
        self.gpu: dict[int, tuple] = {}
        self.cpu: dict[int, tuple] = {}
        self.running: dict[str, int] = {}  # conv -> target positions
        self.prefixes = prefixes or {}
        self.logs: dict[str, list[int]] = {}  # conv -> its tokens, as far as they are known
        self.versions: dict[str, int] = {}  # conv -> how often it was truncated
        self.now = 0.0
        self.kv.take_events()  # record from the start
        self.last_events: list[KvEvent] = []  # those of the last check
        self.stream, self.tier_map = KvEventStream("sim"), TierMap()
        self.router = PrefixIndex()
        self.spilled: dict[tuple[str, int], int] = {}  # the spill index, as written
        self.spills = SpillIndex(self.write_spills)

    def write_spills(self, changes: SpillChanges) -> None:
        for key, slot in changes.items():
            if slot is None:
                self.spilled.pop(key, None)
            else:
                self.spilled[key] = slot

    def tokens(self, conv_id: str, num_positions: int) -> list[int]:
        """The conversation's token log, made up to `num_positions` tokens."""
        log = self.logs.setdefault(conv_id, [])
        number = int.from_bytes(conv_id.encode(), "little") % 1000
        family, length = self.prefixes.get(conv_id, (None, 0))
        for p in range(len(log), num_positions):
            if p < length:
                log.append(10**9 + 1000 * family + p)  # type: ignore[operator]
            else:
                log.append((number * 100 + self.versions.get(conv_id, 0)) * 1000 + p)
        return log

    def cut(self, conv_id: str, num_positions: int) -> None:
        """The conversation's log from `num_positions` on is replaced by new tokens."""
        del self.tokens(conv_id, 0)[num_positions:]
        self.versions[conv_id] = self.versions.get(conv_id, 0) + 1

    def tag(self, conv_id: str, index: int, num_positions: int) -> tuple:
        start = index * BLOCK
        log = self.tokens(conv_id, num_positions)
        return (tuple(log[:start]), tuple(log[start : min(start + BLOCK, num_positions)]))

    def apply_orders(self) -> SwapOrders:
        orders = self.kv.take_orders()
        for op in orders.evict_first:
            self.cpu[op.cpu_slot] = self.gpu[op.gpu_block]
        for op in orders.swap_in:
            self.gpu[op.gpu_block] = self.cpu[op.cpu_slot]
        for op in orders.swap_out:
            self.cpu[op.cpu_slot] = self.gpu[op.gpu_block]
        return orders

    def compute(self, conv_id: str, start: int, end: int) -> None:
        """The step writes positions [start, end): their chunks get fresh tags."""
        conv = self.kv.conversations[conv_id]
        conv.num_positions = max(conv.num_positions, end)
        for index in range(start // BLOCK, (end - 1) // BLOCK + 1):
            self.gpu[conv.chunks[index].gpu_block] = self.tag(conv_id, index, conv.num_positions)

    def check(self) -> None:
        self.kv.check_invariants()
        if not self.prefixes:  # (a shared prefix may outlive its users' own chunks)
            assert_evicted_from_the_leading_end(self.kv)
        events = self.last_events = self.kv.take_events()
        batch = self.stream.batch(events)
        self.tier_map.apply(batch)
        assert self.tier_map.snapshot() == snapshot(self.kv)
        self.router.apply(batch)
        sealed = self.kv.index.by_key.items()
        held = {key: c.tier for key, c in sealed if c.tier is not Tier.DROPPED}
        assert self.router.held("sim") == held
        keys = {c.conv_id: tuple(k.key for k in c.chunks) for c in self.kv.conversations.values()}
        assert self.router.snapshot("sim") == {c: k for c, k in keys.items() if k}
        self.check_chained(events)
        self.spills.apply(events)
        assert self.spilled == {
            (conv.conv_id, i): chunk.cpu_slot
            for conv in self.kv.conversations.values()
            for i, chunk in enumerate(conv.chunks)
            if chunk.cpu_slot is not None
        }
        for conv in self.kv.conversations.values():
            for index, chunk in enumerate(conv.chunks):
                if index * BLOCK >= conv.num_positions:
                    continue
                want = self.tag(conv.conv_id, index, conv.num_positions)
                for memory, block in ((self.gpu, chunk.gpu_block), (self.cpu, chunk.cpu_slot)):
                    if block is not None:
                        self.assert_holds(memory.get(block), want)

    def check_chained(self, events: list[KvEvent]) -> None:
        """Each keyed event's key is its parent's chained with the chunk's tokens."""
        for event in events:
            if event.key is None:
                assert event.parent is None, event
                continue
            assert event.parent is not None, event
            log = self.logs.get(event.conversation_id, [])
            tokens = log[event.index * BLOCK : (event.index + 1) * BLOCK]
            if len(tokens) == BLOCK:  # (the log of a forgotten conversation is gone)
                assert chunk_key(event.parent, tokens) == event.key, event

    @staticmethod
    def assert_holds(got: tuple | None, want: tuple) -> None:
        # positions past a truncation may linger in a block; only the kept ones must be right
        assert got is not None and got[0] == want[0], (got, want)
        assert got[1][: len(want[1])] == want[1], (got, want)


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "decode", "finish", "suspend", "ahead", "truncate", "touch"]),
        st.integers(0, 5),  # conversation
        st.integers(1, 20),  # tokens
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(
    policy=st.sampled_from(list(Policy)),
    num_gpu=st.integers(4, 24),
    num_cpu=st.integers(0, 16),
    script=ops,
)
def test_blocks_are_never_lost_or_shared(policy, num_gpu, num_cpu, script):
    sim = Simulation(policy, num_gpu, num_cpu)
    for op, which, tokens in script:
        sim.now += 1.0
        conv_id = f"c{which}"
        kv = sim.kv
        if op == "admit" and conv_id not in sim.running:
            conv = kv.conversation(conv_id, sim.now)
            target = conv.num_positions + tokens
            if not kv.can_admit(conv, target):
                continue
            try:
                acquired = kv.acquire(conv, target, sim.now)
            except OutOfBlocks:
                sim.check()
                continue
            sim.apply_orders()
            for start, end in acquired.recompute_ranges:
                sim.compute(conv_id, start, end)
            sim.compute(conv_id, conv.num_positions, target)
            sim.running[conv_id] = target
        elif op == "decode" and conv_id in sim.running:
            conv = kv.conversations[conv_id]
            if kv.grow(conv, conv.num_positions + 1, sim.now):
                sim.apply_orders()
                sim.compute(conv_id, conv.num_positions, conv.num_positions + 1)
        elif op == "finish" and conv_id in sim.running:
            del sim.running[conv_id]
            kv.release(kv.conversations[conv_id], sim.now)
        elif op == "suspend" and conv_id in sim.running:
            del sim.running[conv_id]
            conv = kv.conversations[conv_id]
            kv.suspend(conv, conv.num_positions, sim.now)
        elif op == "ahead":
            kv.swap_out_ahead(sim.now)
        elif op == "touch" and conv_id not in sim.running:  # a turn arrives and waits
            kv.touch(conv_id, sim.now)
        elif op == "truncate" and conv_id in kv.conversations and conv_id not in sim.running:
            conv = kv.conversations[conv_id]
            kv.truncate(conv, max(conv.num_positions - tokens, 0))
        sim.apply_orders()
        for running in sim.running:
            assert all(t is Tier.GPU for t in kv.conversations[running].tiers())
        sim.check()


def test_lazy_reclaim_keeps_a_quick_return_on_the_gpu():
    sim = Simulation(Policy.PENSIEVE, num_gpu=8, num_cpu=8)
    kv = sim.kv
    conv = kv.conversation("a", 0.0)
    kv.acquire(conv, 28, 0.0)  # 7 of 8 blocks: below the 25% free threshold
    sim.apply_orders()
    sim.compute("a", 0, 28)
    kv.release(conv, 1.0)
    assert kv.swap_out_ahead(2.0) > 0
    sim.apply_orders()
    assert conv.chunks[0].cpu_slot is not None  # 1 free of 8 -> move one chunk
    acquired = kv.acquire(conv, 30, 3.0)  # comes back before its blocks were reused
    assert acquired.gpu_tokens == 28 and acquired.cpu_tokens == 0
    sim.apply_orders()
    sim.check()


def idle_turns(sim: Simulation, turns: tuple[tuple[str, float], ...]) -> None:
    """One finished 12-position turn (3 chunks) per (conversation, end time)."""
    for name, t in turns:
        conv = sim.kv.conversation(name, t)
        sim.kv.acquire(conv, 12, t)
        sim.apply_orders()
        sim.compute(name, 0, 12)
        sim.kv.release(conv, t)


def test_eviction_takes_the_leading_chunks_of_the_idlest_conversation_first():
    sim = Simulation(Policy.PENSIEVE, num_gpu=7, num_cpu=2)
    kv = sim.kv
    idle_turns(sim, (("old", 0.0), ("new", 50.0)))
    kv.swap_out_ahead(100.0)  # 1 free of 7 < 25%: move one chunk
    sim.apply_orders()
    assert kv.conversations["old"].chunks[0].cpu_slot is not None
    assert all(c.cpu_slot is None for c in kv.conversations["new"].chunks)
    sim.check()


def test_a_chunk_swapped_back_in_keeps_its_cpu_copy_and_leaves_again_without_a_copy():
    sim = Simulation(Policy.PENSIEVE, num_gpu=8, num_cpu=8)
    kv = sim.kv

    def turn(name: str, target: int, t: float) -> SwapOrders:
        conv = kv.conversation(name, t)
        kv.acquire(conv, target, t)
        orders = sim.apply_orders()
        sim.compute(name, conv.num_positions, target)
        kv.release(conv, t)
        sim.check()
        return orders

    turn("a", 16, 0.0)  # 4 full chunks
    first = turn("b", 28, 1.0)  # 7 blocks: 3 of a's chunks are copied out to make room
    assert len(first.evict_first) == 3
    a = kv.conversations["a"]
    back = turn("a", 20, 2.0)  # a returns: 3 chunks swapped in, one new chunk
    swapped_in = {op.cpu_slot for op in back.swap_in}
    assert len(swapped_in) == 3
    assert {c.cpu_slot for c in a.chunks[:4]} - {None} == swapped_in, (
        "a full chunk keeps its CPU copy after a swap-in"
    )
    backed = {i: c.cpu_slot for i, c in enumerate(a.chunks) if c.cpu_slot is not None}
    again = turn("b", 28, 3.0)  # b needs room again: a's backed chunks leave without copies
    assert not {op.cpu_slot for op in again.evict_first + again.swap_out} & swapped_in
    left = [i for i in backed if a.chunks[i].gpu_block is None]
    assert len(left) == 3 and all(a.chunks[i].cpu_slot == backed[i] for i in left)


def test_a_conversation_whose_turn_waits_is_active_again_and_keeps_its_chunks():
    """A turn waiting for admission restarts its conversation's idle time (`touch`): its chunks,
    about to be read, are not the first to leave the GPU or be dropped from the CPU."""
    for policy in (Policy.PENSIEVE, Policy.LRU):
        sim = Simulation(policy, num_gpu=7, num_cpu=3)
        kv = sim.kv
        idle_turns(sim, (("asks", 0.0), ("idle", 50.0)))
        kv.touch("asks", 90.0)  # "asks" was the idlest; its user has just sent a turn
        kv.swap_out_ahead(100.0)  # 1 free of 7 < 25%: move one chunk
        sim.apply_orders()
        assert kv.conversations["idle"].chunks[0].cpu_slot is not None, policy
        assert all(c.cpu_slot is None for c in kv.conversations["asks"].chunks), policy
        kv.touch("unknown", 100.0)  # a first turn: nothing cached, nothing to do
        assert "unknown" not in kv.conversations
        sim.check()


def live(kv: KVCacheManager, chunks: list[Chunk]) -> list[bool]:
    """Which chunks hold a GPU block that is not waiting for reuse."""
    return [c.gpu_block is not None and not kv._reclaiming(c) for c in chunks]


def test_a_waiting_turns_chunks_leave_after_every_idle_conversations():
    """However long a turn has waited for admission, its conversation's chunks are swapped out
    and dropped after those of every conversation still idle: it will read them within
    seconds. Among waiting turns the latest arrival, admitted last, gives way first."""
    for policy in (Policy.PENSIEVE, Policy.LRU):
        sim = Simulation(policy, num_gpu=10, num_cpu=3)
        kv = sim.kv
        idle_turns(sim, (("early", 0.0), ("late", 1.0), ("idle", 50.0)))
        kv.touch("early", 2.0)  # waiting since 2.0 and 3.0: by 100.0 they look idler than
        kv.touch("late", 3.0)  # "idle", whose turn ended at 50.0
        kv.swap_out_ahead(100.0)  # 1 free of 10 < 25%: move two chunks
        sim.apply_orders()
        idle = kv.conversations["idle"]
        assert [c.cpu_slot is not None for c in idle.chunks] == [True, True, False], policy
        for name in ("early", "late"):
            assert all(c.cpu_slot is None for c in kv.conversations[name].chunks), policy
        # 6 blocks wanted now: 1 free, idle's 2 swapped out, then idle's last chunk, then
        # late's two leading ones; early's stay
        kv.moves.ensure_free_gpu(6, 100.0)
        sim.apply_orders()
        assert live(kv, idle.chunks) == [False] * 3, policy
        assert live(kv, kv.conversations["late"].chunks) == [False, False, True], policy
        assert live(kv, kv.conversations["early"].chunks) == [True] * 3, policy
        assert kv.acquire(kv.conversations["early"], 12, 101.0).gpu_tokens == 12, policy
        sim.apply_orders()
        sim.check()


def test_a_waiting_turns_swapped_out_blocks_are_reused_last():
    """A turn that arrives while its conversation's blocks wait for reuse moves them to the
    back of the reuse queue: other swapped-out blocks are overwritten first, so its history is
    still a GPU hit."""
    for touched in (False, True):
        sim = Simulation(Policy.PENSIEVE, num_gpu=10, num_cpu=9)
        kv = sim.kv
        kv.config = replace(kv.config, swap_out_threshold=0.99)  # every idle chunk goes out
        idle_turns(sim, (("back", 0.0), ("other", 1.0), ("third", 2.0)))
        kv.swap_out_ahead(10.0)  # back's 3 chunks first (the idlest), then other's, third's
        sim.apply_orders()
        assert kv.num_free_gpu == 10
        assert all(c.cpu_slot is not None for c in kv.conversations["back"].chunks)
        if touched:
            kv.touch("back", 11.0)  # back's user sends a turn
        new = kv.conversation("new", 11.0)
        kv.acquire(new, 28, 11.0)  # 7 blocks: the free one, then 6 swapped-out ones
        sim.apply_orders()
        sim.compute("new", 0, 28)
        acquired = kv.acquire(kv.conversations["back"], 12, 12.0)
        assert (acquired.gpu_tokens, acquired.cpu_tokens) == ((12, 0) if touched else (0, 12))
        sim.apply_orders()
        sim.check()
