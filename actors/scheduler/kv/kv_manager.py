"""Block accounting of the two-tier conversation cache (pure: no tensors, no I/O).

The manager decides which chunk lives where; the executor moves the bytes it is told to move
(`SwapOrders`). Invariants, checked by `check_invariants` and the property tests:
  - every GPU block and CPU slot is either free or owned by exactly one chunk;
  - a pinned (running) conversation has every chunk on the GPU, and none of them is evicted;
  - a reclaimable GPU block belongs to an unpinned chunk that also has a CPU copy;
  - a chunk may hold a live GPU block and a CPU copy at once ("backed"): a full chunk's KV never
    changes, so the copy made when it was last swapped out stays valid after it comes back. Its
    next eviction from the GPU then copies nothing, and the CPU tier gives up a backed copy
    (which loses nothing) before it drops any chunk;
  - each eviction takes the lowest-ranked chunk at that moment (`eviction.py`), so a conversation
    is evicted from its leading end: what it has dropped is a leading run of its chunks.

Every change of a chunk's place is recorded as a `KvEvent` (see `take_events`), so that a
subscriber to the KV event plane can follow each conversation's chunks from tier to tier.
"""

from __future__ import annotations

from collections import Counter

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.scheduler.kv.block_pool import BlockPool
from pensieve.actors.scheduler.kv.copies import TierCopies
from pensieve.actors.scheduler.kv.eviction import Candidate, CostFn, EvictionOrder
from pensieve.actors.scheduler.kv.kv_cache import Acquired, Chunk, ConversationKV
from pensieve.actors.scheduler.kv.kv_events import ChunkEvents, Where
from pensieve.actors.wire.messages import KvEvent, KvEventKind, Tier
from pensieve.actors.wire.step import CopyKind, CopyOp, SwapOrders


class OutOfBlocks(Exception):
    """Raised when the GPU has no block left that is free, reclaimable or evictable."""


class KVCacheManager:
    def __init__(self, config: CacheConfig, cost: CostFn) -> None:
        self.config = config
        self.cost = cost
        self.gpu = BlockPool(config.num_gpu_blocks)
        self.cpu = BlockPool(config.num_cpu_blocks if config.uses_cpu_tier else 0)
        self.conversations: dict[str, ConversationKV] = {}
        self._pinned: dict[str, ConversationKV] = {}  # the running ones
        # reclaimable GPU blocks, backed CPU slots, and the step's copy orders
        self.copies = TierCopies(self.cpu)
        # which chunks go first (the retention value), over this manager's conversations
        self.eviction = EvictionOrder(config, cost, self.conversations, self.copies.reclaiming)
        # every chunk move, and which chunk owns each GPU block / CPU slot
        self.events = ChunkEvents()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_gpu(self) -> int:
        """GPU blocks that can be written without evicting anything."""
        return self.gpu.num_free + self.copies.num_reusable

    def num_chunks(self, num_positions: int) -> int:
        return -(-num_positions // self.config.block_size)

    def get(self, conv_id: str) -> ConversationKV | None:
        return self.conversations.get(conv_id)

    def conversation(self, conv_id: str, now: float) -> ConversationKV:
        conv = self.conversations.get(conv_id)
        if conv is None:
            conv = self.conversations[conv_id] = ConversationKV(conv_id, last_active=now)
        return conv

    def touch(self, conv_id: str, now: float) -> None:
        """A turn of the conversation arrived: it is active again (its idle time restarts), and
        until it is admitted its chunks are evicted after every idle conversation's. Its GPU
        blocks already swapped out are reused last, so they may still be hits."""
        conv = self.conversations.get(conv_id)
        if conv is None:
            return
        conv.last_active = max(conv.last_active, now)
        conv.waiting_since = now
        for chunk in conv.chunks:
            if chunk.gpu_block is not None:
                self.copies.reuse_last(chunk.gpu_block)

    def unwait(self, conv_id: str) -> None:
        """The conversation's waiting turn left the queue without running (it was rejected)."""
        conv = self.conversations.get(conv_id)
        if conv is not None:
            conv.waiting_since = None

    def restore(self, conv_id: str, num_positions: int, now: float) -> ConversationKV:
        """A conversation known from the token log only (e.g. after a restart): all dropped."""
        conv = self.conversation(conv_id, now)
        if not conv.chunks:
            conv.chunks = [Chunk() for _ in range(self.num_chunks(num_positions))]
            conv.num_positions = num_positions
            for i, chunk in enumerate(conv.chunks):
                self.events.emit(KvEventKind.DROPPED, (conv_id, i), chunk)
        return conv

    def take_orders(self) -> SwapOrders:
        """The copies decided since the last call; blocks swapped out now become reusable."""
        return self.copies.take_orders()

    def copy_owners(self, orders: SwapOrders) -> dict[CopyKind, Counter[str]]:
        """Whose chunks the copies of `orders` move, by kind: conversation id -> copies. Ask
        right after `take_orders`: every CPU slot they name is still its chunk's."""
        where = self.events.cpu_where

        def owners(ops: list[CopyOp]) -> Counter[str]:
            return Counter(where[op.cpu_slot][0] for op in ops if op.cpu_slot in where)

        return {
            CopyKind.EVICT_FIRST: owners(orders.evict_first),
            CopyKind.SWAP_IN: owners(orders.swap_in),
            CopyKind.SWAP_OUT: owners(orders.swap_out),
        }

    def take_events(self) -> list[KvEvent]:
        """The chunk events since the last call, in order. Recording starts with the first call
        (a cache nobody takes events from keeps none): make it before anything is cached."""
        return self.events.take()

    # ---- admission and growth ------------------------------------------------------------

    def blocks_to_admit(self, conv: ConversationKV, num_positions: int) -> int:
        """GPU blocks that admitting `conv` up to `num_positions` would take from the free count."""
        needed = 0
        for i in range(self.num_chunks(num_positions)):
            chunk = conv.chunks[i] if i < len(conv.chunks) else None
            block = None if chunk is None else chunk.gpu_block
            if block is None or self.copies.waits_for_reuse(block):
                needed += 1  # off the GPU, or waiting for reuse: takes one from the free count
        return needed

    def can_admit(self, conv: ConversationKV, num_positions: int) -> bool:
        """Admission keeps more than `admission_reserve` of the GPU free for decode growth."""
        available = self.num_free_gpu + self._num_evictable_gpu(exclude=conv)
        after = available - self.blocks_to_admit(conv, num_positions)
        return after > self.config.admission_reserve * self.gpu.capacity

    def acquire(self, conv: ConversationKV, num_positions: int, now: float) -> Acquired:
        """Pin `conv` and put every chunk of positions [0, num_positions) on the GPU.

        CPU chunks are swapped in, dropped chunks get blocks and are reported for recomputation,
        chunks past `conv.num_positions` are new. Raises OutOfBlocks (changing nothing) if the
        GPU cannot hold them even after evicting every unpinned chunk.
        """
        self.eviction.start_operation()
        reusable = self.gpu.num_free + self.copies.num_reclaimable
        available = reusable + self._num_evictable_gpu(conv)
        if self.blocks_to_admit(conv, num_positions) > available:
            raise OutOfBlocks(f"{conv.conv_id}: history does not fit on the GPU")
        conv.pinned = True
        conv.waiting_since = None
        self._pinned[conv.conv_id] = conv
        conv.maybe_on_gpu = True
        for i, chunk in enumerate(conv.chunks[: self.num_chunks(num_positions)]):
            if chunk.gpu_block is not None and not self.copies.unreclaim(chunk):
                # its swap-out was withdrawn: the copy never happened
                self.copies.free_cpu_copy(chunk)
                self.events.emit(KvEventKind.CPU_FREED, (conv.conv_id, i), chunk)
        self._ensure_free_gpu(self.blocks_to_admit(conv, num_positions), now)
        gpu_tokens = cpu_tokens = swapped_in = 0
        recompute: list[tuple[int, int]] = []
        for i in range(self.num_chunks(num_positions)):
            if i == len(conv.chunks):
                conv.chunks.append(Chunk())
            chunk, where = conv.chunks[i], (conv.conv_id, i)
            start, end = self._known_range(conv, i)
            full = end - start == self.config.block_size  # else this turn writes into it
            if chunk.gpu_block is not None:
                gpu_tokens += end - start
                if chunk.cpu_slot is not None and not full:
                    self.copies.free_cpu_copy(chunk)  # stale once the turn writes its tail
                    self.events.emit(KvEventKind.CPU_FREED, where, chunk)
                elif chunk.cpu_slot is not None:
                    self.copies.back(chunk)  # its swap-out was issued earlier
            elif chunk.cpu_slot is not None:
                chunk.gpu_block = self._take_gpu_block(where)
                self.copies.swap_in(chunk, full)
                self.events.emit(KvEventKind.SWAPPED_IN, where, chunk)
                cpu_tokens += end - start
                swapped_in += 1
            else:
                chunk.gpu_block = self._take_gpu_block(where)
                if end > start:
                    _extend(recompute, start, end)
                kind = KvEventKind.RECOMPUTED if end > start else KvEventKind.STORED
                self.events.emit(kind, where, chunk)
        return Acquired(gpu_tokens, cpu_tokens, tuple(recompute), swapped_in)

    def grow(self, conv: ConversationKV, num_positions: int, now: float) -> bool:
        """Give a running conversation blocks up to `num_positions`; False if the GPU is full."""
        self.eviction.start_operation()
        missing = self.num_chunks(num_positions) - len(conv.chunks)
        if missing <= 0:
            return True
        try:
            self._ensure_free_gpu(missing, now)
        except OutOfBlocks:
            return False
        for _ in range(missing):
            where = (conv.conv_id, len(conv.chunks))
            conv.chunks.append(Chunk(gpu_block=self._take_gpu_block(where)))
            self.events.emit(KvEventKind.STORED, where, conv.chunks[-1])
        conv.maybe_on_gpu = True
        return True

    def truncate(self, conv: ConversationKV, num_positions: int) -> None:
        """Forget positions >= num_positions (their chunks are freed; a partial chunk stays)."""
        keep = self.num_chunks(num_positions)
        if len(conv.chunks) > keep:
            self.events.removed(conv.conv_id, keep)
        for chunk in conv.chunks[keep:]:
            self._drop(chunk)
        del conv.chunks[keep:]
        conv.num_positions = min(conv.num_positions, num_positions)

    # ---- end of a turn -------------------------------------------------------------------

    def release(self, conv: ConversationKV, now: float) -> None:
        """The conversation's request finished: its chunks become evictable."""
        conv.pinned = False
        conv.waiting_since = None
        self._pinned.pop(conv.conv_id, None)
        conv.last_active = now
        if self.config.policy is Policy.STATELESS:
            self.forget(conv.conv_id)

    def suspend(self, conv: ConversationKV, num_positions: int, now: float) -> int:
        """Unpin a running conversation mid-turn and push its chunks off the GPU; returns how
        many blocks are copied out (the others had a valid CPU copy already, or are dropped)."""
        self.eviction.start_operation()
        self.truncate(conv, num_positions)
        conv.pinned = False
        self._pinned.pop(conv.conv_id, None)
        conv.last_active = now
        conv.waiting_since = now  # requeued
        copied = 0
        for chunk in conv.chunks:
            if chunk.gpu_block is not None:
                slot = self._slot_for_eviction(chunk, None, now)
                copied += self._evict_now(conv, chunk, slot)
        return copied

    def forget(self, conv_id: str) -> None:
        conv = self.conversations.pop(conv_id, None)
        self._pinned.pop(conv_id, None)
        if conv is not None:
            if conv.chunks:
                self.events.removed(conv_id, 0)
            for chunk in conv.chunks:
                self._drop(chunk)

    def swap_out_ahead(self, now: float) -> int:
        """Swap out ahead of time while the free GPU share is under the threshold; returns moves."""
        self.eviction.start_operation()
        if not self.cpu.capacity:
            return 0
        target = self.config.swap_out_threshold * self.gpu.capacity
        moved = 0
        if self.num_free_gpu >= target:
            return 0
        if not self.eviction.swap_out_due(now, self.num_free_gpu):
            return 0
        for candidate in self.eviction.gpu_candidates(now):
            if self.num_free_gpu >= target:
                break
            conv, chunk = candidate.conv, candidate.chunk
            if chunk.cpu_slot is not None:  # backed: its CPU copy is valid, nothing to copy
                if self.copies.reclaim_backed(chunk):
                    where = self.events.gpu_where[chunk.gpu_block]  # type: ignore[index]
                    self.events.emit(KvEventKind.SWAPPED_OUT, where, chunk)
                    self.eviction.joined_cpu(conv, candidate.index)
                    moved += 1
                continue
            slot = self._take_cpu_slot(candidate, now, ahead=True)
            if slot is None:
                self.eviction.swap_out_blocked(now, self.num_free_gpu)
                break
            self._swap_out(conv, chunk, slot)
            moved += 1
        return moved

    # ---- internals -----------------------------------------------------------------------

    def _known_range(self, conv: ConversationKV, index: int) -> tuple[int, int]:
        start = index * self.config.block_size
        end = min(start + self.config.block_size, conv.num_positions)
        return start, max(start, end)

    def _num_evictable_gpu(self, exclude: ConversationKV) -> int:
        """Unpinned live GPU chunks: every owned block that is not pinned or waiting for reuse."""
        owned = self.gpu.capacity - self.num_free_gpu
        for conv in self._pinned.values():
            owned -= len(conv.chunks)  # a pinned conversation has every chunk live on the GPU
        if not exclude.pinned:
            owned -= sum(
                1 for c in exclude.chunks if c.gpu_block is not None and not self._reclaiming(c)
            )
        return owned

    def _reclaiming(self, chunk: Chunk) -> bool:
        """Swapped out, its GPU block kept until reused."""
        return self.copies.reclaiming(chunk)

    def _slot_for_eviction(
        self, chunk: Chunk, candidate: Candidate | None, now: float
    ) -> int | None:
        """Where an evicted chunk's KV goes: its valid CPU copy, a new slot, or nowhere."""
        if chunk.cpu_slot is not None:
            return chunk.cpu_slot
        return self._take_cpu_slot(candidate, now) if self.cpu.capacity else None

    def _ensure_free_gpu(self, needed: int, now: float) -> None:
        """Evict on demand (lowest value first) until `needed` blocks can be taken."""
        if self.gpu.num_free + self.copies.num_reclaimable >= needed:
            return
        for candidate in self.eviction.gpu_candidates(now):
            if self.gpu.num_free + self.copies.num_reclaimable >= needed:
                return
            chunk = candidate.chunk
            self._evict_now(candidate.conv, chunk, self._slot_for_eviction(chunk, candidate, now))
        if self.gpu.num_free + self.copies.num_reclaimable < needed:
            raise OutOfBlocks(f"need {needed} GPU blocks, {self.gpu.num_free} free")

    def _take_gpu_block(self, where: Where) -> int:
        """A block for the chunk at `where`: a free one, else the oldest reclaimable one."""
        block = self.gpu.allocate()
        if block is None:
            reclaimed = self.copies.reclaim_oldest()
            if reclaimed is None:
                raise OutOfBlocks("no free or reclaimable GPU block")
            block, chunk = reclaimed
            chunk.gpu_block = None  # its data lives on in the CPU copy
            self.events.emit(KvEventKind.RECLAIMED, self.events.gpu_where[block], chunk)
        self.events.gpu_where[block] = where
        return block

    def _evict_now(self, conv: ConversationKV, chunk: Chunk, slot: int | None) -> bool:
        """Free a GPU block for reuse within this step: copy it out first (unless its CPU copy
        is valid already), or drop it. True if a copy was ordered."""
        block = chunk.gpu_block
        assert block is not None and not self._reclaiming(chunk)
        where = self.events.gpu_where[block]
        copied = False
        if slot is not None and slot == chunk.cpu_slot:
            self.copies.unback(slot)
        elif slot is not None:
            self.copies.evict_first(block, slot)
            chunk.cpu_slot = slot
            self.events.cpu_where[slot] = where
            copied = True
        conv.maybe_on_cpu = conv.maybe_on_cpu or slot is not None
        chunk.gpu_block = None
        self.gpu.free(block)
        self.events.emit(
            KvEventKind.DROPPED if slot is None else KvEventKind.SWAPPED_OUT, where, chunk
        )
        if slot is not None:
            self.eviction.joined_cpu(conv, where[1])
        return copied

    def _take_cpu_slot(
        self, candidate: Candidate | None, now: float, ahead: bool = False
    ) -> int | None:
        """A free CPU slot for `candidate`, dropping a CPU chunk that goes before it if needed
        (any, if None); `ahead`: for a swap-out that could wait (see `cpu_victim`)."""
        slot = self.cpu.allocate()
        if slot is not None:
            return slot
        backed = self.copies.take_backed()
        if backed is not None:  # a copy of a chunk that lives on the GPU too: nothing is lost
            slot, chunk = backed
            self.events.emit(KvEventKind.CPU_FREED, self.events.cpu_where[slot], chunk)
            return slot
        chunk = self.eviction.cpu_victim(candidate, now, ahead=ahead)
        if chunk is None:
            return None
        where = self.events.cpu_where[chunk.cpu_slot]  # type: ignore[index]
        self._drop(chunk)
        self.events.emit(KvEventKind.DROPPED, where, chunk)
        return self.cpu.allocate()

    def _swap_out(self, conv: ConversationKV, chunk: Chunk, slot: int) -> None:
        self.copies.swap_out(chunk, slot)
        conv.maybe_on_cpu = True
        where = self.events.cpu_where[slot] = self.events.gpu_where[chunk.gpu_block]  # type: ignore[index]
        self.events.emit(KvEventKind.SWAPPED_OUT, where, chunk)
        self.eviction.joined_cpu(conv, where[1])

    def _drop(self, chunk: Chunk) -> None:
        if chunk.gpu_block is not None:
            self.copies.forget_gpu(chunk)
            self.gpu.free(chunk.gpu_block)
            chunk.gpu_block = None
        self.copies.free_cpu_copy(chunk)

    def check_invariants(self) -> None:
        _check_invariants(self)


def _check_invariants(kv: KVCacheManager) -> None:
    """The invariants of the module docstring (the property tests call it after each move)."""
    owned_gpu: dict[int, Chunk] = {}
    owned_cpu: dict[int, Chunk] = {}
    for conv in kv.conversations.values():
        for i, chunk in enumerate(conv.chunks):
            for block, owned, where in (
                (chunk.gpu_block, owned_gpu, kv.events.gpu_where),
                (chunk.cpu_slot, owned_cpu, kv.events.cpu_where),
            ):
                if block is not None:
                    assert block not in owned, f"block {block} owned twice"
                    owned[block] = chunk
                    assert where.get(block) == (conv.conv_id, i), f"block {block}: wrong owner"
            if conv.pinned:
                assert chunk.tier is Tier.GPU, f"{conv.conv_id}: pinned chunk off the GPU"
                assert not kv._reclaiming(chunk), f"{conv.conv_id}: pinned chunk reclaimed"
    pinned = {c.conv_id for c in kv.conversations.values() if c.pinned}
    assert pinned == set(kv._pinned), "the running set is out of step"
    for conv in kv.conversations.values():  # the scan hint never hides an evictable chunk
        live = any(c.gpu_block is not None and not kv._reclaiming(c) for c in conv.chunks)
        assert conv.maybe_on_gpu or not live, f"{conv.conv_id}: live chunks hidden from scans"
    pending_cpu = kv.copies.pending_slots()
    assert not pending_cpu & set(owned_cpu), "a slot being read is owned again"
    for pool, owned, pending in (
        (kv.gpu, owned_gpu, set()),
        (kv.cpu, owned_cpu, pending_cpu),
    ):
        for block in range(pool.capacity):
            held = block in owned or block in pending
            assert pool.is_free(block) != held, f"block {block}: free and owned disagree"
        assert pool.num_free + len(owned) + len(pending) == pool.capacity
    both = sum(
        1
        for conv in kv.conversations.values()
        for c in conv.chunks
        if c.gpu_block is not None and c.cpu_slot is not None
    )
    assert both == kv.copies.check(), "a chunk on both tiers is unaccounted for"


def _extend(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))
