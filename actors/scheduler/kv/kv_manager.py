"""Block accounting of the two-tier conversation cache (pure: no tensors, no I/O).

The manager decides which chunk lives where; the executor moves the bytes it is told to move
(`SwapOrders`). Invariants, checked by `check_invariants` and the property tests:
  - every GPU block and CPU slot is either free or owned by exactly one chunk;
  - a pinned (running) conversation has every chunk on the GPU, and none of them is evicted;
  - a reclaimable GPU block belongs to an unpinned chunk that also has a CPU copy;
  - a chunk may hold a live GPU block and a CPU copy at once ("backed"): a full chunk's KV never
    changes, so the copy made when it was last swapped out stays valid after it comes back. Its
    next eviction from the GPU then copies nothing, and the CPU tier gives up a backed copy
    (which loses nothing) before it drops any chunk that lives only on the CPU.

Every change of a chunk's place is recorded as a `KvEvent` (see `take_events`), so that a
subscriber to the KV event plane can follow each conversation's chunks from tier to tier.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.scheduler.kv.block_pool import BlockPool
from pensieve.actors.scheduler.kv.kv_cache import (
    Acquired,
    Chunk,
    ConversationKV,
    CopyOp,
    SwapOrders,
    Tier,
)
from pensieve.actors.wire.messages import KvEvent, KvEventKind

# seconds to recompute one chunk whose last position attends to l positions (its retention cost)
CostFn = Callable[[int], float]
# seconds a swap-out blocked by a CPU tier of higher-valued chunks waits before it is tried again
# (sooner if the GPU's free count drops): values change only as idle time grows
RETRY_S = 0.1
Where = tuple[str, int]  # a chunk's conversation and index


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
        self._reclaimable: OrderedDict[int, Chunk] = OrderedDict()  # reusable now
        self._reclaim_next: dict[int, Chunk] = {}  # reusable from the next step on
        self._cpu_free_next: list[int] = []  # slots read by this step's swap-ins
        # CPU slots of backed chunks, oldest first; a slot read by this step's swap-in is held
        # apart until the step's copies are issued (an evict-first copy must not overwrite it)
        self._backed: OrderedDict[int, Chunk] = OrderedDict()
        self._backed_next: dict[int, Chunk] = {}
        self._cpu_victims: Iterator[tuple[float, ConversationKV, Chunk]] | None = None
        self._cpu_victim_next: tuple[float, ConversationKV, Chunk] | None = None
        self._orders = SwapOrders()
        # when a swap-out was last blocked, and the GPU's free count then (see RETRY_S)
        self._blocked: tuple[float, int] | None = None
        # which chunk owns each GPU block / CPU slot, so that an event can name a chunk reached
        # through its block (reclaim, a CPU victim); an entry counts only while the block is owned
        self._gpu_where: dict[int, Where] = {}
        self._cpu_where: dict[int, Where] = {}
        self._events: list[KvEvent] | None = None  # None: nobody takes them (see take_events)

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_gpu(self) -> int:
        """GPU blocks that can be written without evicting anything."""
        return self.gpu.num_free + len(self._reclaimable) + len(self._reclaim_next)

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
            if chunk.gpu_block is not None and chunk.gpu_block in self._reclaimable:
                self._reclaimable.move_to_end(chunk.gpu_block)

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
                self._emit(KvEventKind.DROPPED, (conv_id, i), chunk)
        return conv

    def take_orders(self) -> SwapOrders:
        """The copies decided since the last call; blocks swapped out now become reusable."""
        orders, self._orders = self._orders, SwapOrders()
        for block, chunk in self._reclaim_next.items():
            self._reclaimable[block] = chunk
        self._reclaim_next.clear()
        for slot in self._cpu_free_next:
            self.cpu.free(slot)
        self._cpu_free_next.clear()
        self._backed.update(self._backed_next)
        self._backed_next.clear()
        return orders

    def take_events(self) -> list[KvEvent]:
        """The chunk events since the last call, in order. Recording starts with the first call
        (a cache nobody takes events from keeps none): make it before anything is cached."""
        events, self._events = self._events or [], []
        return events

    # ---- admission and growth ------------------------------------------------------------

    def blocks_to_admit(self, conv: ConversationKV, num_positions: int) -> int:
        """GPU blocks that admitting `conv` up to `num_positions` would take from the free count."""
        needed = 0
        for i in range(self.num_chunks(num_positions)):
            chunk = conv.chunks[i] if i < len(conv.chunks) else None
            block = None if chunk is None else chunk.gpu_block
            if block is None or block in self._reclaimable or block in self._reclaim_next:
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
        self._cpu_victims = None
        available = self.gpu.num_free + len(self._reclaimable) + self._num_evictable_gpu(conv)
        if self.blocks_to_admit(conv, num_positions) > available:
            raise OutOfBlocks(f"{conv.conv_id}: history does not fit on the GPU")
        conv.pinned = True
        conv.waiting_since = None
        self._pinned[conv.conv_id] = conv
        conv.maybe_on_gpu = True
        for i, chunk in enumerate(conv.chunks[: self.num_chunks(num_positions)]):
            if chunk.gpu_block is not None and not self._unreclaim(chunk):
                self._free_cpu_copy(chunk)  # its swap-out was withdrawn: the copy never happened
                self._emit(KvEventKind.CPU_FREED, (conv.conv_id, i), chunk)
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
                    self._free_cpu_copy(chunk)  # stale once the turn writes its tail
                    self._emit(KvEventKind.CPU_FREED, where, chunk)
                elif chunk.cpu_slot is not None and not self._is_backed(chunk):
                    self._backed[chunk.cpu_slot] = chunk  # its swap-out was issued earlier
            elif chunk.cpu_slot is not None:
                chunk.gpu_block = self._take_gpu_block(where)
                self._orders.swap_in.append(CopyOp(chunk.gpu_block, chunk.cpu_slot))
                if full:
                    self._backed_next[chunk.cpu_slot] = chunk  # read by this step's swap-in
                else:
                    self._cpu_free_next.append(chunk.cpu_slot)  # read by this step's swap-in
                    chunk.cpu_slot = None
                self._emit(KvEventKind.SWAPPED_IN, where, chunk)
                cpu_tokens += end - start
                swapped_in += 1
            else:
                chunk.gpu_block = self._take_gpu_block(where)
                if end > start:
                    _extend(recompute, start, end)
                kind = KvEventKind.RECOMPUTED if end > start else KvEventKind.STORED
                self._emit(kind, where, chunk)
        return Acquired(gpu_tokens, cpu_tokens, tuple(recompute), swapped_in)

    def grow(self, conv: ConversationKV, num_positions: int, now: float) -> bool:
        """Give a running conversation blocks up to `num_positions`; False if the GPU is full."""
        self._cpu_victims = None
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
            self._emit(KvEventKind.STORED, where, conv.chunks[-1])
        conv.maybe_on_gpu = True
        return True

    def truncate(self, conv: ConversationKV, num_positions: int) -> None:
        """Forget positions >= num_positions (their chunks are freed; a partial chunk stays)."""
        keep = self.num_chunks(num_positions)
        if len(conv.chunks) > keep:
            self._emit_removed(conv.conv_id, keep)
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
        self._cpu_victims = None
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
                self._emit_removed(conv_id, 0)
            for chunk in conv.chunks:
                self._drop(chunk)

    def swap_out_ahead(self, now: float) -> int:
        """Swap out ahead of time while the free GPU share is under the threshold; returns moves."""
        self._cpu_victims = None
        if not self.cpu.capacity:
            return 0
        target = self.config.swap_out_threshold * self.gpu.capacity
        moved = 0
        if self.num_free_gpu >= target:
            return 0
        if self._blocked is not None:
            since, free = self._blocked
            if now - since < RETRY_S and self.num_free_gpu >= free:
                return 0
        self._blocked = None
        for value, conv, chunk in self._gpu_candidates(now):
            if self.num_free_gpu >= target:
                break
            if chunk.cpu_slot is not None:  # backed: its CPU copy is valid, nothing to copy
                if chunk.cpu_slot in self._backed:
                    del self._backed[chunk.cpu_slot]
                    self._reclaimable[chunk.gpu_block] = chunk  # type: ignore[index]
                    where = self._gpu_where[chunk.gpu_block]  # type: ignore[index]
                    self._emit(KvEventKind.SWAPPED_OUT, where, chunk)
                    moved += 1
                continue
            slot = self._take_cpu_slot(value, now)
            if slot is None:
                self._blocked = (now, self.num_free_gpu)
                break
            self._swap_out(conv, chunk, slot)
            moved += 1
        return moved

    # ---- internals -----------------------------------------------------------------------

    def _known_range(self, conv: ConversationKV, index: int) -> tuple[int, int]:
        start = index * self.config.block_size
        end = min(start + self.config.block_size, conv.num_positions)
        return start, max(start, end)

    def _value(self, conv: ConversationKV, index: int, now: float) -> float:
        """Retention value: lowest is evicted first (leading chunks of idle conversations)."""
        if self.config.policy is Policy.LRU:
            return conv.last_active + index * 1e-9
        context = min((index + 1) * self.config.block_size, max(conv.num_positions, 1))
        idle = max(now - conv.last_active, 1e-6)
        return self.cost(context) / idle

    def _gpu_candidates(self, now: float) -> Iterator[tuple[float, ConversationKV, Chunk]]:
        """Unpinned chunks that hold a GPU block and no CPU copy, lowest value first."""
        return self._candidates(now, Tier.GPU)

    def _cpu_candidates(self, now: float) -> Iterator[tuple[float, ConversationKV, Chunk]]:
        """Unpinned chunks that hold a CPU slot and no GPU block, lowest value first."""
        return self._candidates(now, Tier.CPU)

    def _candidates(self, now: float, tier: Tier) -> Iterator[tuple[float, ConversationKV, Chunk]]:
        """Lazily, lowest value first: a merge of the conversations' eligible chunks.

        Within a conversation values grow with the chunk index (every chunk shares its idle time
        and a later chunk attends to more context), so a conversation's first eligible chunk is
        its cheapest and a heap of one entry per conversation ranks them all. Eligibility is
        checked as the merge advances, so chunks moved meanwhile are skipped.

        Conversations with a turn waiting for admission come after all the others, whatever the
        policy: the latest arrival first (it is admitted last), each from its leading chunk, at
        an infinite value (so no swap-out drops them from the CPU tier to make room).
        """
        on_gpu = tier is Tier.GPU

        def movable(chunk: Chunk) -> bool:
            if on_gpu:  # a live GPU copy (not already swapped out and waiting for reuse)
                return chunk.gpu_block is not None and not self._reclaiming(chunk)
            return chunk.cpu_slot is not None and chunk.gpu_block is None

        def eligible(conv: ConversationKV) -> Iterator[int]:
            for i, chunk in enumerate(conv.chunks):
                if movable(chunk):
                    yield i

        heap: list[tuple[float, int, int, ConversationKV, Iterator[int]]] = []
        waiting: list[ConversationKV] = []
        for order, conv in enumerate(self.conversations.values()):
            if conv.pinned or not (conv.maybe_on_gpu if on_gpu else conv.maybe_on_cpu):
                continue
            if conv.waiting_since is not None:
                waiting.append(conv)
                continue
            indices = eligible(conv)
            first = next(indices, None)
            if first is None:  # nothing of this tier left here: skip it until something moves in
                if on_gpu:  # a live GPU chunk of an idle conversation appears only through
                    conv.maybe_on_gpu = False  # acquire / grow, which set the hint again
                else:
                    conv.maybe_on_cpu = any(c.cpu_slot is not None for c in conv.chunks)
                continue
            heap.append((self._value(conv, first, now), first, order, conv, indices))
        heapq.heapify(heap)
        while heap:
            value, index, order, conv, indices = heapq.heappop(heap)
            if conv.pinned:
                continue
            chunk = conv.chunks[index] if index < len(conv.chunks) else None
            if chunk is not None and movable(chunk):
                yield value, conv, chunk
            following = next(indices, None)
            if following is not None:
                entry = (self._value(conv, following, now), following, order, conv, indices)
                heapq.heappush(heap, entry)
        waiting.sort(key=lambda c: c.waiting_since or 0.0, reverse=True)
        for conv in waiting:
            for index in eligible(conv):
                if conv.pinned or conv.waiting_since is None:
                    break  # admitted (or released) meanwhile
                yield math.inf, conv, conv.chunks[index]

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
        return chunk.gpu_block in self._reclaimable or chunk.gpu_block in self._reclaim_next

    def _is_backed(self, chunk: Chunk) -> bool:
        return chunk.cpu_slot in self._backed or chunk.cpu_slot in self._backed_next

    def _slot_for_eviction(self, chunk: Chunk, value: float | None, now: float) -> int | None:
        """Where an evicted chunk's KV goes: its valid CPU copy, a new slot, or nowhere."""
        if chunk.cpu_slot is not None:
            return chunk.cpu_slot
        return self._take_cpu_slot(value, now) if self.cpu.capacity else None

    def _ensure_free_gpu(self, needed: int, now: float) -> None:
        """Evict on demand (lowest value first) until `needed` blocks can be taken."""
        if self.gpu.num_free + len(self._reclaimable) >= needed:
            return
        for value, conv, chunk in self._gpu_candidates(now):
            if self.gpu.num_free + len(self._reclaimable) >= needed:
                return
            self._evict_now(conv, chunk, self._slot_for_eviction(chunk, value, now))
        if self.gpu.num_free + len(self._reclaimable) < needed:
            raise OutOfBlocks(f"need {needed} GPU blocks, {self.gpu.num_free} free")

    def _take_gpu_block(self, where: Where) -> int:
        """A block for the chunk at `where`: a free one, else the oldest reclaimable one."""
        block = self.gpu.allocate()
        if block is None:
            if not self._reclaimable:
                raise OutOfBlocks("no free or reclaimable GPU block")
            block, chunk = self._reclaimable.popitem(last=False)
            chunk.gpu_block = None  # its data lives on in the CPU copy
            self._orders.fence = True
            self._emit(KvEventKind.RECLAIMED, self._gpu_where[block], chunk)
        self._gpu_where[block] = where
        return block

    def _evict_now(self, conv: ConversationKV, chunk: Chunk, slot: int | None) -> bool:
        """Free a GPU block for reuse within this step: copy it out first (unless its CPU copy
        is valid already), or drop it. True if a copy was ordered."""
        block = chunk.gpu_block
        assert block is not None and not self._reclaiming(chunk)
        where = self._gpu_where[block]
        copied = False
        if slot is not None and slot == chunk.cpu_slot:
            self._backed.pop(slot, None)
            self._backed_next.pop(slot, None)  # stays owned: the swap-in reading it comes first
        elif slot is not None:
            self._orders.evict_first.append(CopyOp(block, slot))
            chunk.cpu_slot = slot
            self._cpu_where[slot] = where
            copied = True
        conv.maybe_on_cpu = conv.maybe_on_cpu or slot is not None
        chunk.gpu_block = None
        self.gpu.free(block)
        self._emit(KvEventKind.DROPPED if slot is None else KvEventKind.SWAPPED_OUT, where, chunk)
        return copied

    def _take_cpu_slot(self, value: float | None, now: float) -> int | None:
        """A free CPU slot, dropping lower-valued CPU chunks if needed (any, if value is None)."""
        slot = self.cpu.allocate()
        if slot is not None:
            return slot
        if self._backed:  # a copy of a chunk that lives on the GPU too: nothing is lost
            slot, chunk = self._backed.popitem(last=False)
            chunk.cpu_slot = None
            self._emit(KvEventKind.CPU_FREED, self._cpu_where[slot], chunk)
            return slot
        if self._cpu_victims is None:  # one ranking per operation, consumed as it goes
            self._cpu_victims = self._cpu_candidates(now)
            self._cpu_victim_next = None
        victim = self._cpu_victim_next or next(self._cpu_victims, None)
        self._cpu_victim_next = None
        while victim is not None:
            victim_value, _, chunk = victim
            if chunk.cpu_slot is not None and chunk.gpu_block is None:
                if value is not None and victim_value >= value:
                    self._cpu_victim_next = victim  # keep it for a later, higher-valued ask
                    return None
                where = self._cpu_where[chunk.cpu_slot]
                self._drop(chunk)
                self._emit(KvEventKind.DROPPED, where, chunk)
                return self.cpu.allocate()
            victim = next(self._cpu_victims, None)  # moved since it was ranked
        return None

    def _swap_out(self, conv: ConversationKV, chunk: Chunk, slot: int) -> None:
        assert chunk.gpu_block is not None and chunk.cpu_slot is None
        self._orders.swap_out.append(CopyOp(chunk.gpu_block, slot))
        chunk.cpu_slot = slot
        conv.maybe_on_cpu = True
        self._reclaim_next[chunk.gpu_block] = chunk
        self._cpu_where[slot] = self._gpu_where[chunk.gpu_block]
        self._emit(KvEventKind.SWAPPED_OUT, self._cpu_where[slot], chunk)

    def _unreclaim(self, chunk: Chunk) -> bool:
        """A chunk whose block was waiting for reuse is needed again: keep the GPU copy.

        False if its swap-out was withdrawn (decided this step, never issued): then its CPU
        slot holds nothing."""
        assert chunk.gpu_block is not None
        if self._reclaimable.pop(chunk.gpu_block, None) is not None:
            return True
        return not self._cancel_swap_out(chunk)

    def _cancel_swap_out(self, chunk: Chunk) -> bool:
        """Withdraw a swap-out not yet issued, so its slot can be reused safely."""
        if (
            chunk.gpu_block is not None
            and self._reclaim_next.pop(chunk.gpu_block, None) is not None
        ):
            self._orders.swap_out.remove(CopyOp(chunk.gpu_block, chunk.cpu_slot))  # type: ignore[arg-type]
            return True
        return False

    def _free_cpu_copy(self, chunk: Chunk) -> None:
        slot = chunk.cpu_slot
        if slot is None:
            return
        chunk.cpu_slot = None
        self._backed.pop(slot, None)
        if self._backed_next.pop(slot, None) is not None:
            self._cpu_free_next.append(slot)  # read by this step's swap-in
        else:
            self.cpu.free(slot)

    def _drop(self, chunk: Chunk) -> None:
        if chunk.gpu_block is not None:
            if self._reclaimable.pop(chunk.gpu_block, None) is None:
                self._cancel_swap_out(chunk)
            self.gpu.free(chunk.gpu_block)
            chunk.gpu_block = None
        self._free_cpu_copy(chunk)

    def _emit(self, kind: KvEventKind, where: Where, chunk: Chunk) -> None:
        """Record that the chunk at `where` changed (`kind`) and is now where `chunk` says."""
        if self._events is not None:
            conv_id, index = where
            self._events.append(KvEvent(kind, conv_id, index, chunk.gpu_block, chunk.cpu_slot))

    def _emit_removed(self, conv_id: str, index: int) -> None:
        if self._events is not None:
            self._events.append(KvEvent(KvEventKind.REMOVED, conv_id, index))

    def check_invariants(self) -> None:
        owned_gpu: dict[int, Chunk] = {}
        owned_cpu: dict[int, Chunk] = {}
        for conv in self.conversations.values():
            for i, chunk in enumerate(conv.chunks):
                for block, owned, where in (
                    (chunk.gpu_block, owned_gpu, self._gpu_where),
                    (chunk.cpu_slot, owned_cpu, self._cpu_where),
                ):
                    if block is not None:
                        assert block not in owned, f"block {block} owned twice"
                        owned[block] = chunk
                        assert where.get(block) == (conv.conv_id, i), f"block {block}: wrong owner"
                if conv.pinned:
                    assert chunk.tier is Tier.GPU, f"{conv.conv_id}: pinned chunk off the GPU"
                    assert not self._reclaiming(chunk), f"{conv.conv_id}: pinned chunk reclaimed"
        pinned = {c.conv_id for c in self.conversations.values() if c.pinned}
        assert pinned == set(self._pinned), "the running set is out of step"
        for conv in self.conversations.values():  # the scan hint never hides an evictable chunk
            live = any(c.gpu_block is not None and not self._reclaiming(c) for c in conv.chunks)
            assert conv.maybe_on_gpu or not live, f"{conv.conv_id}: live chunks hidden from scans"
        pending_cpu = set(self._cpu_free_next)
        assert not pending_cpu & set(owned_cpu), "a slot being read is owned again"
        for pool, owned, pending in (
            (self.gpu, owned_gpu, set()),
            (self.cpu, owned_cpu, pending_cpu),
        ):
            for block in range(pool.capacity):
                held = block in owned or block in pending
                assert pool.is_free(block) != held, f"block {block}: free and owned disagree"
            assert pool.num_free + len(owned) + len(pending) == pool.capacity
        reclaim = list(self._reclaimable.items()) + list(self._reclaim_next.items())
        for block, chunk in reclaim:
            assert chunk.gpu_block == block and chunk.cpu_slot is not None
        backed = list(self._backed.items()) + list(self._backed_next.items())
        for slot, chunk in backed:
            assert chunk.cpu_slot == slot and chunk.gpu_block is not None
            assert not self._reclaiming(chunk), f"slot {slot}: backed and swapped out at once"
        both = sum(
            1
            for conv in self.conversations.values()
            for c in conv.chunks
            if c.gpu_block is not None and c.cpu_slot is not None
        )
        assert both == len(reclaim) + len(backed), "a chunk on both tiers is unaccounted for"


def _extend(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))
