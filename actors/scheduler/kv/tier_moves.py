"""Chunk moves between the cache tiers (pure: no tensors, no I/O): evictions from the GPU,
swap-outs ahead of time, and taking a GPU block or CPU slot for a chunk.

Each move is a part of the cache manager's books (`kv_manager.py`), whose invariants it keeps:
the copies it orders go into the step's `SwapOrders` (`copies.py`), every change of a chunk's
place is recorded as a `KvEvent`, and each eviction takes the lowest-ranked chunk at that moment
(`eviction.py`); a chunk leaving both the GPU and CPU tiers goes to the disk tier if it is worth
a place there (`disk_saves.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pensieve.actors.scheduler.kv.eviction import Candidate
from pensieve.actors.scheduler.kv.kv_cache import Chunk
from pensieve.actors.wire.messages import KvEventKind

if TYPE_CHECKING:
    from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager


class OutOfBlocks(Exception):
    """Raised when the GPU has no block left that is free, reclaimable or evictable."""


class TierMoves:
    """The cache manager's moves of chunks between tiers (its `swap_out_ahead`, and the
    evictions and allocations of its admission and growth)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def swap_out_ahead(self, now: float) -> int:
        """Swap out ahead of time while the free GPU share is under the threshold; returns moves."""
        kv = self.kv
        kv.eviction.start_operation()
        if not kv.cpu.capacity:
            return 0
        target = kv.config.swap_out_threshold * kv.gpu.capacity
        moved = 0
        if kv.num_free_gpu >= target:
            return 0
        if not kv.eviction.swap_out_due(now, kv.num_free_gpu):
            return 0
        for candidate in kv.eviction.gpu_candidates(now):
            if kv.num_free_gpu >= target:
                break
            chunk = candidate.chunk
            if chunk.cpu_slot is not None:  # backed: its CPU copy is valid, nothing to copy
                if kv.copies.reclaim_backed(chunk):
                    kv.events.emit(KvEventKind.SWAPPED_OUT, chunk)
                    kv.eviction.joined_cpu(chunk)
                    moved += 1
                continue
            slot = self.take_cpu_slot(candidate, now, ahead=True)
            if slot is None:
                kv.eviction.swap_out_blocked(now, kv.num_free_gpu)
                break
            self._swap_out(chunk, slot)
            moved += 1
        return moved

    def slot_for_eviction(
        self, chunk: Chunk, candidate: Candidate | None, now: float
    ) -> int | None:
        """Where an evicted chunk's KV goes: its valid CPU copy, a new slot, or nowhere."""
        if chunk.cpu_slot is not None:
            return chunk.cpu_slot
        return self.take_cpu_slot(candidate, now) if self.kv.cpu.capacity else None

    def ensure_free_gpu(self, needed: int, now: float) -> None:
        """Evict on demand (lowest value first) until `needed` blocks can be taken."""
        kv = self.kv
        if kv.gpu.num_free + kv.copies.num_reclaimable >= needed:
            return
        for candidate in kv.eviction.gpu_candidates(now):
            if kv.gpu.num_free + kv.copies.num_reclaimable >= needed:
                return
            chunk = candidate.chunk
            self.evict_now(chunk, self.slot_for_eviction(chunk, candidate, now), now)
        if kv.gpu.num_free + kv.copies.num_reclaimable < needed:
            raise OutOfBlocks(f"need {needed} GPU blocks, {kv.gpu.num_free} free")

    def take_gpu_block(self, chunk: Chunk) -> int:
        """A block for `chunk`: a free one, else the oldest reclaimable one."""
        kv = self.kv
        block = kv.gpu.allocate()
        if block is None:
            reclaimed = kv.copies.reclaim_oldest()
            if reclaimed is None:
                raise OutOfBlocks("no free or reclaimable GPU block")
            block, owner = reclaimed
            owner.gpu_block = None  # its data lives on in the CPU copy
            kv.events.emit(KvEventKind.RECLAIMED, owner)
        kv.events.gpu_where[block] = chunk
        return block

    def evict_now(self, chunk: Chunk, slot: int | None, now: float) -> bool:
        """Free a GPU block for reuse within this step: copy it out first (unless its CPU copy
        is valid already), or drop it (to the disk tier, if it is worth a place there). True if
        a copy was ordered."""
        kv = self.kv
        block = chunk.gpu_block
        assert block is not None and not kv.copies.reclaiming(chunk) and not chunk.pins
        copied = False
        if slot is not None and slot == chunk.cpu_slot:
            kv.copies.unback(slot)
        elif slot is None:
            self._to_disk(chunk, now, gpu_block=block)
        else:
            kv.copies.evict_first(block, slot)
            chunk.cpu_slot = slot
            kv.events.cpu_where[slot] = chunk
            copied = True
        chunk.gpu_block = None
        kv.gpu.free(block)
        kv.events.emit(KvEventKind.DROPPED if slot is None else KvEventKind.SWAPPED_OUT, chunk)
        if slot is not None:
            self._joined_cpu(chunk)
        return copied

    def take_cpu_slot(
        self, candidate: Candidate | None, now: float, ahead: bool = False
    ) -> int | None:
        """A free CPU slot for `candidate`, dropping a CPU chunk that goes before it if needed
        (any, if None); `ahead`: for a swap-out that could wait (see `cpu_victim`)."""
        kv = self.kv
        slot = kv.cpu.allocate()
        if slot is not None:
            return slot
        backed = kv.copies.take_backed()
        if backed is not None:  # a copy of a chunk that lives on the GPU too: nothing is lost
            slot, chunk = backed
            kv.events.emit(KvEventKind.CPU_FREED, chunk)
            return slot
        chunk = kv.eviction.cpu_victim(candidate, now, ahead=ahead)
        if chunk is None:
            return None
        if chunk.cpu_slot is not None:
            self._to_disk(chunk, now, cpu_slot=chunk.cpu_slot)  # GPU -> CPU -> disk
        self.drop(chunk)
        kv.events.emit(KvEventKind.DROPPED, chunk)
        return kv.cpu.allocate()

    def drop(self, chunk: Chunk) -> None:
        """Free the chunk's GPU block and CPU slot (it is on no tier any more)."""
        kv = self.kv
        if chunk.gpu_block is not None:
            kv.copies.forget_gpu(chunk)
            kv.gpu.free(chunk.gpu_block)
            chunk.gpu_block = None
        kv.copies.free_cpu_copy(chunk)

    def _to_disk(
        self, chunk: Chunk, now: float, cpu_slot: int | None = None, gpu_block: int | None = None
    ) -> None:
        """The chunk leaves the GPU and CPU tiers from `cpu_slot` or `gpu_block`: saved for the
        disk tier if it is worth a place there (`DiskSaves.evicted`)."""
        if self.kv.disk_saves is not None:
            self.kv.disk_saves.evicted(chunk, now, cpu_slot, gpu_block)

    def _swap_out(self, chunk: Chunk, slot: int) -> None:
        self.kv.copies.swap_out(chunk, slot)
        self.kv.events.cpu_where[slot] = chunk
        self.kv.events.emit(KvEventKind.SWAPPED_OUT, chunk)
        self._joined_cpu(chunk)

    def _joined_cpu(self, chunk: Chunk) -> None:
        for user in chunk.users.values():
            user.maybe_on_cpu = True
        self.kv.eviction.joined_cpu(chunk)
        if self.kv.disk_saves is not None:
            self.kv.disk_saves.joined(chunk)
