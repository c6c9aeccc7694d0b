"""Chunks with a copy on both tiers, and the copies one engine step orders (pure).

A full chunk's KV never changes, so a chunk may hold a GPU block and a CPU slot at once:
  - reclaimable: swapped out, its GPU block kept until another chunk needs it (a hit until then);
    a swap-out ordered this step makes the block reusable only from the next step on, once the
    copy is issued;
  - backed: live on the GPU again, its CPU copy still valid, so its next eviction from the GPU
    copies nothing, and the CPU tier gives up such a copy (which loses nothing) before it drops a
    chunk that lives only on the CPU. A slot read by this step's swap-in joins them from the next
    step on (an evict-first copy of this step must not overwrite it);
  - a slot read by this step's swap-in and then no longer needed is freed from the next step on.
"""

from __future__ import annotations

from collections import OrderedDict

from pensieve.actors.scheduler.kv.block_pool import BlockPool
from pensieve.actors.scheduler.kv.kv_cache import Chunk
from pensieve.actors.wire.step import CopyOp, DiskLoad, DiskSave, SwapOrders


class TierCopies:
    """The books of chunks on both tiers, keyed by GPU block (reclaimable) or CPU slot (backed),
    oldest first, and the step's `SwapOrders`. Freed CPU slots go back to `cpu`."""

    def __init__(self, cpu: BlockPool) -> None:
        self.cpu = cpu
        self.orders = SwapOrders()
        self._reclaimable: OrderedDict[int, Chunk] = OrderedDict()  # reusable now
        self._reclaim_next: dict[int, Chunk] = {}  # reusable from the next step on
        self._cpu_free_next: list[int] = []  # slots read by this step's swap-ins
        self._backed: OrderedDict[int, Chunk] = OrderedDict()
        self._backed_next: dict[int, Chunk] = {}

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_reclaimable(self) -> int:
        """GPU blocks reusable now."""
        return len(self._reclaimable)

    @property
    def num_reusable(self) -> int:
        """GPU blocks reusable now or from the next step on."""
        return len(self._reclaimable) + len(self._reclaim_next)

    def waits_for_reuse(self, block: int) -> bool:
        return block in self._reclaimable or block in self._reclaim_next

    def reclaiming(self, chunk: Chunk) -> bool:
        """Swapped out, its GPU block kept until reused."""
        return chunk.gpu_block in self._reclaimable or chunk.gpu_block in self._reclaim_next

    def is_backed(self, chunk: Chunk) -> bool:
        return chunk.cpu_slot in self._backed or chunk.cpu_slot in self._backed_next

    # ---- the step boundary -----------------------------------------------------------------

    def take_orders(self) -> SwapOrders:
        """The copies ordered since the last call; what they wait for becomes reusable."""
        orders, self.orders = self.orders, SwapOrders()
        for block, chunk in self._reclaim_next.items():
            self._reclaimable[block] = chunk
        self._reclaim_next.clear()
        for slot in self._cpu_free_next:
            self.cpu.free(slot)
        self._cpu_free_next.clear()
        self._backed.update(self._backed_next)
        self._backed_next.clear()
        return orders

    # ---- copies ----------------------------------------------------------------------------

    def swap_in(self, chunk: Chunk, full: bool) -> None:
        """Copy the chunk's CPU slot into its (new) GPU block; a full chunk keeps its CPU copy,
        a partial one loses it (the turn writes its tail)."""
        assert chunk.gpu_block is not None and chunk.cpu_slot is not None
        self.orders.swap_in.append(CopyOp(chunk.gpu_block, chunk.cpu_slot))
        if full:
            self._backed_next[chunk.cpu_slot] = chunk  # read by this step's swap-in
        else:
            self._cpu_free_next.append(chunk.cpu_slot)  # read by this step's swap-in
            chunk.cpu_slot = None

    def swap_out(self, chunk: Chunk, slot: int) -> None:
        """Copy the chunk's GPU block into `slot`; the block is reusable from the next step."""
        assert chunk.gpu_block is not None and chunk.cpu_slot is None
        self.orders.swap_out.append(CopyOp(chunk.gpu_block, slot))
        chunk.cpu_slot = slot
        self._reclaim_next[chunk.gpu_block] = chunk

    def evict_first(self, block: int, slot: int) -> None:
        """Copy `block` into `slot` before this step's writes reuse the block."""
        self.orders.evict_first.append(CopyOp(block, slot))

    def can_save(self, cpu_slot: int | None) -> bool:
        """Whether a chunk leaving the tiers from `cpu_slot` (None: from its GPU block) can be
        saved for the disk tier: not if a copy of this step targets the slot (it holds no whole
        chunk yet; the chunk is recomputed when needed)."""
        targets = (op.cpu_slot for op in (*self.orders.swap_out, *self.orders.evict_first))
        return cpu_slot is None or all(slot != cpu_slot for slot in targets)

    def save_to_disk(
        self, key: bytes, removals: list[bytes], cpu_slot: int | None, gpu_block: int | None
    ) -> None:
        """The disk tier removes the chunks of `removals`, then the executor keeps the bytes of
        the chunk leaving the tiers from `cpu_slot` or `gpu_block` for it (`DiskSave`). The
        executor takes a step's removals before its saves, so a chunk saved earlier in this
        step is removed by withdrawing its save (else its save would take the slot meant for
        this one)."""
        saves = self.orders.disk_save
        for removal in removals:
            withdrawn = [save for save in saves if save.key == removal]
            for save in withdrawn:
                saves.remove(save)
            if not withdrawn:
                self.orders.disk_drop.append(removal)
        saves.append(DiskSave(cpu_slot, key, gpu_block))

    def load_from_disk(self, key: bytes, block: int) -> None:
        """Copy the chunk of `key`, read from the disk tier, into `block`."""
        self.orders.disk_load.append(DiskLoad(key, block))

    def cancel_swap_out(self, chunk: Chunk) -> bool:
        """Withdraw a swap-out not yet issued, so its slot can be reused safely."""
        if (
            chunk.gpu_block is not None
            and self._reclaim_next.pop(chunk.gpu_block, None) is not None
        ):
            self.orders.swap_out.remove(CopyOp(chunk.gpu_block, chunk.cpu_slot))  # type: ignore[arg-type]
            return True
        return False

    # ---- reclaimable GPU blocks --------------------------------------------------------------

    def reuse_last(self, block: int) -> None:
        """The block's chunk is wanted soon: reuse it after every other reclaimable block."""
        if block in self._reclaimable:
            self._reclaimable.move_to_end(block)

    def reclaim_oldest(self) -> tuple[int, Chunk] | None:
        """The oldest reclaimable block, taken from its chunk's books (its data lives on in the
        CPU copy); the step's copies must finish before it is written (a fence)."""
        if not self._reclaimable:
            return None
        block, chunk = self._reclaimable.popitem(last=False)
        self.orders.fence = True
        return block, chunk

    def unreclaim(self, chunk: Chunk) -> bool:
        """A chunk whose block was waiting for reuse is needed again: keep the GPU copy.

        False if its swap-out was withdrawn (decided this step, never issued): then its CPU
        slot holds nothing."""
        assert chunk.gpu_block is not None
        if self._reclaimable.pop(chunk.gpu_block, None) is not None:
            return True
        return not self.cancel_swap_out(chunk)

    def forget_gpu(self, chunk: Chunk) -> None:
        """The chunk's GPU block is about to be freed: it waits for reuse no more."""
        if chunk.gpu_block is not None and self._reclaimable.pop(chunk.gpu_block, None) is None:
            self.cancel_swap_out(chunk)

    # ---- backed CPU copies -----------------------------------------------------------------

    def back(self, chunk: Chunk) -> None:
        """The chunk lives on the GPU and its CPU copy stays valid (its swap-out was issued)."""
        if chunk.cpu_slot is not None and not self.is_backed(chunk):
            self._backed[chunk.cpu_slot] = chunk

    def reclaim_backed(self, chunk: Chunk) -> bool:
        """Swap a backed chunk out for free: its block becomes reclaimable now. False if its
        copy is not a backed one of an earlier step."""
        if chunk.cpu_slot not in self._backed:
            return False
        del self._backed[chunk.cpu_slot]  # type: ignore[arg-type]
        self._reclaimable[chunk.gpu_block] = chunk  # type: ignore[index]
        return True

    def unback(self, slot: int) -> None:
        """The chunk of `slot` leaves the GPU: its CPU copy is its only one (the slot stays
        owned; a swap-in reading it this step comes first)."""
        self._backed.pop(slot, None)
        self._backed_next.pop(slot, None)

    def take_backed(self) -> tuple[int, Chunk] | None:
        """The oldest backed CPU slot, taken from its chunk (which lives on the GPU)."""
        if not self._backed:
            return None
        slot, chunk = self._backed.popitem(last=False)
        chunk.cpu_slot = None
        return slot, chunk

    def free_cpu_copy(self, chunk: Chunk) -> None:
        slot = chunk.cpu_slot
        if slot is None:
            return
        chunk.cpu_slot = None
        self._backed.pop(slot, None)
        if self._backed_next.pop(slot, None) is not None:
            self._cpu_free_next.append(slot)  # read by this step's swap-in
        else:
            self.cpu.free(slot)

    # ---- invariants --------------------------------------------------------------------------

    def pending_slots(self) -> set[int]:
        """CPU slots read by this step's swap-ins, freed at the next `take_orders`."""
        return set(self._cpu_free_next)

    def check(self) -> int:
        """Assert the books agree with their chunks; returns how many chunks they hold."""
        reclaim = list(self._reclaimable.items()) + list(self._reclaim_next.items())
        for block, chunk in reclaim:
            assert chunk.gpu_block == block and chunk.cpu_slot is not None
        backed = list(self._backed.items()) + list(self._backed_next.items())
        for slot, chunk in backed:
            assert chunk.cpu_slot == slot and chunk.gpu_block is not None
            assert not self.reclaiming(chunk), f"slot {slot}: backed and swapped out at once"
        return len(reclaim) + len(backed)
