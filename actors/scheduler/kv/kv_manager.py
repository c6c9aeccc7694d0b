"""Block accounting of the two-tier conversation cache (pure: no tensors, no I/O).

The manager decides which chunk lives where; the executor moves the bytes it is told to move
(`SwapOrders`). A chunk may serve several conversations: a full chunk whose KV is known is sealed
under its content key (`chunk_keys.py`, `content_index.py`), and a conversation whose token log
has the same prefix uses that chunk instead of one of its own (`sharing.py`: `lookup`, and when
a turn ends, `seal` merges a chunk computed twice). Invariants, checked by `check_invariants`
and the property tests:
  - every GPU block and CPU slot is either free or owned by exactly one chunk, and a chunk is
    freed only when no conversation uses it;
  - a chunk's users are exactly the conversations that list it, and its pins those of them that
    run; only a sealed chunk has more than one user, and it is full in every one of them;
  - a pinned (running) conversation has every chunk on the GPU, and none of them is evicted
    (nor is a chunk it shares with idle conversations);
  - a reclaimable GPU block belongs to an unpinned chunk that also has a CPU copy;
  - a chunk may hold a live GPU block and a CPU copy at once ("backed"): a full chunk's KV never
    changes, so the copy made when it was last swapped out stays valid after it comes back. Its
    next eviction from the GPU then copies nothing, and the CPU tier gives up a backed copy
    (which loses nothing) before it drops any chunk;
  - each eviction takes the lowest-ranked chunk at that moment (`eviction.py`), once for all of
    its users; a conversation gives up its own chunks from the leading end.

Every change of a chunk's place is recorded as a `KvEvent` (see `take_events`), so that a
subscriber to the KV event plane can follow each conversation's chunks from tier to tier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.scheduler.kv.block_pool import BlockPool
from pensieve.actors.scheduler.kv.content_index import ContentIndex
from pensieve.actors.scheduler.kv.copies import TierCopies
from pensieve.actors.scheduler.kv.disk_books import DiskBooks
from pensieve.actors.scheduler.kv.disk_saves import DiskSaves, WriteBack
from pensieve.actors.scheduler.kv.eviction import CostFn, EvictionOrder
from pensieve.actors.scheduler.kv.invariants import check_invariants
from pensieve.actors.scheduler.kv.kv_cache import Acquired, Chunk, ConversationKV, Found
from pensieve.actors.scheduler.kv.kv_events import ChunkEvents
from pensieve.actors.scheduler.kv.sharing import ChunkUsers, ContentSharing
from pensieve.actors.scheduler.kv.tier_moves import OutOfBlocks, TierMoves
from pensieve.actors.wire.chunk_keys import Namespace
from pensieve.actors.wire.messages import KvEvent, KvEventKind
from pensieve.actors.wire.step import CopyKind, CopyOp, SwapOrders


class KVCacheManager:
    """`namespace`: how the chunks of conversations made without one of their own are keyed
    (`chunk_keys.Namespace`; None: a seed of no model or tenant)."""

    def __init__(
        self, config: CacheConfig, cost: CostFn, namespace: Namespace | None = None
    ) -> None:
        self.config = config
        self.cost = cost
        self.namespace = namespace or Namespace(b"")
        self.gpu = BlockPool(config.num_gpu_blocks)
        self.cpu = BlockPool(config.num_cpu_blocks if config.uses_cpu_tier else 0)
        self.conversations: dict[str, ConversationKV] = {}
        # sealed chunks by content key, and the shared ones; each chunk's users and pins
        self.index = ContentIndex()
        self.moves = TierMoves(self)  # evictions, swap-outs, and blocks and slots taken
        self.users = ChunkUsers(self.index, self.moves.drop)
        self.sharing = ContentSharing(self)
        # reclaimable GPU blocks, backed CPU slots, and the step's copy orders
        self.copies = TierCopies(self.cpu)
        # which chunks go first (the retention value), over this manager's conversations
        self.eviction = EvictionOrder(
            config, cost, self.conversations, self.copies.reclaiming, self.index.shared
        )
        # every chunk move, and which chunk owns each GPU block / CPU slot
        self.events = ChunkEvents()
        self.disk: DiskBooks | None = None  # the disk tier's books (`attach_disk`)
        self.disk_saves: DiskSaves | None = None  # and which chunks are saved there, when

    def attach_disk(
        self, num_slots: int, keys: Iterable[bytes], worth: Callable[[int], bool] | None = None
    ) -> None:
        """Chunks leaving the GPU and CPU tiers go to a disk tier of `num_slots` chunks, which
        holds `keys` now (left there by a run before), ranked by the same retention value;
        while serving, those `worth` reading back (`DiskSaves`)."""
        if self.config.disk_tier:
            self.disk = DiskBooks(num_slots, keys, self.eviction)
            self.disk_saves = DiskSaves(self.disk, self.copies, worth)

    def stop_disk_writes(self) -> None:
        """The disk tier writes no more (disk full, an I/O error): nothing more is saved."""
        if self.disk is not None:
            self.disk.writable = False

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_gpu(self) -> int:
        """GPU blocks that can be written without evicting anything."""
        return self.gpu.num_free + self.copies.num_reusable

    def num_chunks(self, num_positions: int) -> int:
        return -(-num_positions // self.config.block_size)

    def get(self, conv_id: str) -> ConversationKV | None:
        return self.conversations.get(conv_id)

    def conversation(
        self, conv_id: str, now: float, namespace: Namespace | None = None
    ) -> ConversationKV:
        """The conversation, made if new (its chunks keyed in `namespace`, else the manager's)."""
        conv = self.conversations.get(conv_id)
        if conv is None:
            keyed = self.namespace if namespace is None else namespace
            conv = ConversationKV(conv_id, last_active=now, namespace=keyed)
            self.conversations[conv_id] = conv
        return conv

    @property
    def num_shared_chunks(self) -> int:
        return len(self.index.shared)

    def num_copies_saved(self) -> int:
        """Blocks and slots that sharing saves now: each shared chunk, on each tier it is on,
        would take one per user without it (O(shared chunks))."""
        return sum(
            (len(chunk.users) - 1) * (self.live_on_gpu(chunk) + (chunk.cpu_slot is not None))
            for chunk in self.index.shared.values()
        )

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
            for _ in range(self.num_chunks(num_positions)):
                self.events.emit(KvEventKind.DROPPED, self.users.new_chunk(conv))
            conv.num_positions = num_positions
        return conv

    def disk_write_back(self, now: float) -> WriteBack:
        """What a clean stop writes to the disk tier (`DiskSaves.write_back`) of the sealed
        chunks on the CPU and GPU tiers. Ask between steps."""
        if self.disk_saves is None:
            return [], [], []
        chunks = [chunk for chunk in self.index.by_key.values() if self.place(chunk)]
        return self.disk_saves.write_back(chunks, now)

    def take_orders(self) -> SwapOrders:
        """The copies decided since the last call; blocks swapped out now become reusable."""
        if self.disk_saves is not None:
            self.disk_saves.step_boundary()
        return self.copies.take_orders()

    def write_ahead(self, now: float) -> int:
        """Save for the disk tier chunks still on the CPU tier (`DiskSaves.ahead`), in the
        next step's orders; the number saved."""
        return 0 if self.disk_saves is None else self.disk_saves.ahead(now)

    def copy_owners(self, orders: SwapOrders) -> dict[CopyKind, Counter[str]]:
        """Whose chunks the copies of `orders` move, by kind: conversation id -> copies. Ask
        right after `take_orders`: every CPU slot they name is still its chunk's."""
        where = self.events.cpu_where

        def owners(ops: list[CopyOp]) -> Counter[str]:
            slots = [op.cpu_slot for op in ops if op.cpu_slot in where]
            return Counter(conv_id for slot in slots for conv_id in where[slot].users)

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

    def acquire(
        self,
        conv: ConversationKV,
        num_positions: int,
        now: float,
        on_disk: frozenset[bytes] = frozenset(),
    ) -> Acquired:
        """Pin `conv` and put every chunk of positions [0, num_positions) on the GPU.

        CPU chunks are swapped in; dropped chunks get blocks and are loaded from disk where
        their content key is in `on_disk` (read for this turn), else reported for
        recomputation; chunks past `conv.num_positions` are new. Raises OutOfBlocks (changing
        nothing) if the GPU cannot hold them even after evicting every unpinned chunk.
        """
        self.eviction.start_operation()
        reusable = self.gpu.num_free + self.copies.num_reclaimable
        available = reusable + self._num_evictable_gpu(conv)
        if self.blocks_to_admit(conv, num_positions) > available:
            raise OutOfBlocks(f"{conv.conv_id}: history does not fit on the GPU")
        for chunk in conv.chunks[: self.num_chunks(num_positions)]:
            if chunk.key is not None and chunk.gpu_block is None and chunk.cpu_slot is None:
                # a dropped sealed chunk: recomputed as one of its own, which must not be found
                # before it is written (`seal` gives it to the other users then)
                self.users.replace(conv, chunk, Chunk(chunk.index))
        self.users.pin(conv)
        conv.waiting_since = None
        conv.maybe_on_gpu = True
        for chunk in conv.chunks[: self.num_chunks(num_positions)]:
            if chunk.gpu_block is not None and not self.copies.unreclaim(chunk):
                # its swap-out was withdrawn: the copy never happened
                self.copies.free_cpu_copy(chunk)
                self.events.emit(KvEventKind.CPU_FREED, chunk)
        self.moves.ensure_free_gpu(self.blocks_to_admit(conv, num_positions), now)
        gpu_tokens = cpu_tokens = disk_tokens = swapped_in = 0
        recompute: list[tuple[int, int]] = []
        for i in range(self.num_chunks(num_positions)):
            chunk = conv.chunks[i] if i < len(conv.chunks) else self.users.new_chunk(conv)
            start, end = self._known_range(conv, i)
            full = end - start == self.config.block_size  # else this turn writes into it
            if chunk.gpu_block is not None:
                gpu_tokens += end - start
                if chunk.cpu_slot is not None and not full:
                    self.copies.free_cpu_copy(chunk)  # stale once the turn writes its tail
                    self.events.emit(KvEventKind.CPU_FREED, chunk)
                elif chunk.cpu_slot is not None:
                    self.copies.back(chunk)  # its swap-out was issued earlier
            elif chunk.cpu_slot is not None:
                chunk.gpu_block = self.moves.take_gpu_block(chunk)
                self.copies.swap_in(chunk, full)
                self.events.emit(KvEventKind.SWAPPED_IN, chunk)
                cpu_tokens += end - start
                swapped_in += 1
            else:
                chunk.gpu_block = self.moves.take_gpu_block(chunk)
                key = conv.keys[i] if full and i < len(conv.keys) else None
                if key is not None and key in on_disk:
                    self.copies.load_from_disk(key, chunk.gpu_block)
                    if self.disk is not None:
                        self.disk.read_by(key, conv, i)
                    disk_tokens += end - start
                elif end > start:
                    _extend(recompute, start, end)
                kind = KvEventKind.RECOMPUTED if end > start else KvEventKind.STORED
                self.events.emit(kind, chunk)
        return Acquired(gpu_tokens, cpu_tokens, tuple(recompute), swapped_in, disk_tokens)

    def grow(self, conv: ConversationKV, num_positions: int, now: float) -> bool:
        """Give a running conversation blocks up to `num_positions`; False if the GPU is full."""
        self.eviction.start_operation()
        missing = self.num_chunks(num_positions) - len(conv.chunks)
        if missing <= 0:
            return True
        try:
            self.moves.ensure_free_gpu(missing, now)
        except OutOfBlocks:
            return False
        for _ in range(missing):
            chunk = self.users.new_chunk(conv)
            chunk.gpu_block = self.moves.take_gpu_block(chunk)
            self.events.emit(KvEventKind.STORED, chunk)
        conv.maybe_on_gpu = True
        return True

    def truncate(self, conv: ConversationKV, num_positions: int) -> None:
        """Forget positions >= num_positions (their chunks are freed; a partial chunk stays)."""
        keep = self.num_chunks(num_positions)
        if len(conv.chunks) > keep:
            self.events.removed(conv.conv_id, keep)
        for chunk in conv.chunks[keep:]:
            self.users.leave(conv, chunk)
        del conv.chunks[keep:]
        del conv.keys[num_positions // self.config.block_size :]
        conv.num_positions = min(conv.num_positions, num_positions)
        if keep and num_positions % self.config.block_size and conv.chunks[-1].key is not None:
            last = conv.chunks[-1]  # the next turn writes into its tail
            if len(last.users) == 1:
                self.index.unseal(last)
                self.events.emit(KvEventKind.UNSEALED, last)
            else:  # shared: its kept positions are recomputed into a chunk of its own
                self.users.replace(conv, last, Chunk(last.index))
                self.events.emit_for(KvEventKind.DROPPED, conv.conv_id, conv.chunks[-1])

    # ---- end of a turn -------------------------------------------------------------------

    def release(
        self, conv: ConversationKV, now: float, tokens: Sequence[int] | None = None
    ) -> None:
        """The conversation's request finished: its chunks become evictable. With `tokens` (its
        token log) its full computed chunks are sealed for sharing (`seal`)."""
        self.users.unpin(conv)
        conv.waiting_since = None
        conv.last_active = now
        if self.config.policy is Policy.STATELESS:
            self.forget(conv.conv_id)
        elif tokens is not None:
            self.seal(conv, tokens)

    def suspend(
        self,
        conv: ConversationKV,
        num_positions: int,
        now: float,
        tokens: Sequence[int] | None = None,
    ) -> int:
        """Unpin a running conversation mid-turn and push its own chunks off the GPU (shared ones
        are ranked as any other); returns how many blocks are copied out (the others had a valid
        CPU copy already, or are dropped). `tokens`: as for `release`."""
        self.eviction.start_operation()
        self.truncate(conv, num_positions)
        self.users.unpin(conv)
        conv.last_active = now
        conv.waiting_since = now  # requeued
        if tokens is not None:
            self.seal(conv, tokens)
        copied = 0
        for chunk in conv.chunks:
            if chunk.gpu_block is not None and len(chunk.users) == 1:
                slot = self.moves.slot_for_eviction(chunk, None, now)
                copied += self.moves.evict_now(chunk, slot, now)
        return copied

    def forget(self, conv_id: str) -> None:
        conv = self.conversations.pop(conv_id, None)
        if conv is not None:
            self.users.unpin(conv)
            if conv.chunks:
                self.events.removed(conv_id, 0)
            for chunk in conv.chunks:
                self.users.leave(conv, chunk)

    # ---- sharing by content (sharing.py) -------------------------------------------------

    def seal(self, conv: ConversationKV, tokens: Sequence[int]) -> None:
        """Seal the idle conversation's full computed chunks of `tokens` (`ContentSharing`)."""
        self.sharing.seal(conv, tokens)

    def rekey(self, conv: ConversationKV, namespace: Namespace) -> None:
        """Key the idle conversation's chunks in `namespace` from now on (`ContentSharing`)."""
        self.sharing.rekey(conv, namespace)

    def lookup(
        self, conv: ConversationKV, tokens: Sequence[int], on_disk: Collection[bytes] = ()
    ) -> Found:
        """Attach to the idle conversation the longest cached run of leading full chunks of
        `tokens`, its own or found by content, or read from disk (`ContentSharing`)."""
        return self.sharing.lookup(conv, tokens, on_disk)

    def swap_out_ahead(self, now: float) -> int:
        """Swap out ahead of time while the free GPU share is under the threshold; returns moves."""
        return self.moves.swap_out_ahead(now)

    # ---- internals -----------------------------------------------------------------------

    def _known_range(self, conv: ConversationKV, index: int) -> tuple[int, int]:
        start = index * self.config.block_size
        end = min(start + self.config.block_size, conv.num_positions)
        return start, max(start, end)

    def _num_evictable_gpu(self, exclude: ConversationKV) -> int:
        """Unpinned live GPU chunks: every owned block that is not pinned or waiting for reuse."""
        owned = self.gpu.capacity - self.num_free_gpu - self.users.num_pinned_chunks
        if not exclude.pinned:
            owned -= sum(1 for c in exclude.chunks if not c.pins and self.live_on_gpu(c))
        return owned

    def _reclaiming(self, chunk: Chunk) -> bool:
        """Swapped out, its GPU block kept until reused."""
        return self.copies.reclaiming(chunk)

    def live_on_gpu(self, chunk: Chunk) -> bool:
        return chunk.gpu_block is not None and not self._reclaiming(chunk)

    def place(self, chunk: Chunk) -> int:
        """2 live on the GPU, 1 on the CPU tier (its GPU block may wait for reuse), 0 dropped."""
        if self.live_on_gpu(chunk):
            return 2
        return 1 if chunk.cpu_slot is not None else 0

    def check_invariants(self) -> None:
        check_invariants(self)


def _extend(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))
