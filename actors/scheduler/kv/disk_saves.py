"""The scheduler's side of the disk tier's writes: which chunks are saved, and when.

A chunk is saved for the disk tier (a `DiskSave` in the step's orders) when its books admit it
(`DiskBooks.admit`: a free slot, or the place of a chunk on disk worth less), at one of three
times:

- **ahead of its eviction** (`ahead`), while it still sits in its CPU slot. A chunk saved as it
  leaves the CPU tier is copied out of its slot on the step's path, since the step that evicts
  it reuses the slot (the swap-out that needed room); one saved earlier is copied by the disk
  tier's writer thread in the background (`actors/executor/disk_cache.py`), and its eviction
  later saves nothing: the disk holds its key already. So every chunk that joins the CPU tier (a
  swap-out, an evict-first copy) is queued; once its copy has been issued (the step boundary
  after it joined), up to `AHEAD_PER_STEP` queued chunks a step are saved, oldest first, if
  they are still on the CPU tier, sealed and not on disk. A slot saved this way that a later
  step overwrites before the writer copied it is copied then by the executor.
- **as it leaves the tiers** (`evicted`): from its CPU slot, or its GPU block when it has no
  CPU copy, unless a copy of the same step targets that slot (it holds no whole chunk yet).
- **at a clean stop** (`write_back`): the sealed chunks of both tiers not on disk yet, the most
  valuable first.

While serving, only chunks worth reading back are saved (`worth`: reading one costs less than
recomputing it, by the disk's read rate and `Cost(l)` at its position, as the engine decides
for each chunk a turn needs); the others would be recomputed rather than read, so writing them
would cost the disk's bandwidth and the host's for nothing. A clean stop saves every chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from pensieve.actors.scheduler.kv.copies import TierCopies
from pensieve.actors.scheduler.kv.disk_books import DiskBooks
from pensieve.actors.scheduler.kv.kv_cache import Chunk

AHEAD_PER_STEP = 16  # saves a step: a 4 MiB chunk each on an 8B model, ~1 GB/s at 15 ms a step

WriteBack = tuple[list[bytes], list[tuple[int, bytes]], list[tuple[int, bytes]]]


class DiskSaves:
    def __init__(
        self, books: DiskBooks, copies: TierCopies, worth: Callable[[int], bool] | None = None
    ) -> None:
        self.books = books
        self.copies = copies
        # whether the chunk at this index is worth reading back (default: every one)
        self.worth = worth or (lambda index: True)
        self._joined: list[Chunk] = []  # joined the CPU tier; its copy is in this step's orders
        self._due: deque[Chunk] = deque()  # their copies issued: can be saved ahead
        self.num_ahead = 0  # saved ahead of their eviction
        self.num_on_eviction = 0  # saved as they left the tiers (copied on the step's path)
        self.num_not_worth = 0  # not saved: cheaper to recompute than to read back

    def counts(self) -> dict[str, int]:
        return {
            "ahead": self.num_ahead,
            "on_eviction": self.num_on_eviction,
            "not_worth_reading": self.num_not_worth,
        }

    def joined(self, chunk: Chunk) -> None:
        """The chunk joined the CPU tier (its copy is in this step's orders)."""
        self._joined.append(chunk)

    def step_boundary(self) -> None:
        """The step's orders were taken: the copies of the chunks that joined are issued."""
        self._due.extend(self._joined)
        self._joined.clear()

    def ahead(self, now: float) -> int:
        """Order the saves of up to `AHEAD_PER_STEP` due chunks; the number ordered."""
        saved = 0
        while self._due and saved < AHEAD_PER_STEP and self.books.writable:
            chunk = self._due.popleft()
            slot, key = chunk.cpu_slot, chunk.key
            if slot is None or key is None or key in self.books:
                continue
            if not self.worth(chunk.index):
                self.num_not_worth += 1
                continue
            if self._save(chunk, now, cpu_slot=slot):
                saved += 1
        self.num_ahead += saved
        return saved

    def evicted(
        self, chunk: Chunk, now: float, cpu_slot: int | None = None, gpu_block: int | None = None
    ) -> None:
        """The chunk leaves the GPU and CPU tiers from `cpu_slot` or `gpu_block`."""
        if chunk.key is None or chunk.key in self.books:
            return
        if not self.worth(chunk.index):
            self.num_not_worth += 1
            return
        if self._save(chunk, now, cpu_slot, gpu_block):
            self.num_on_eviction += 1

    def write_back(self, chunks: Iterable[Chunk], now: float) -> WriteBack:
        """What a clean stop writes of these sealed chunks of the tiers: the keys to remove
        first, then (CPU slot, key) and (GPU block, key), the most valuable first, as far as
        the disk's budget takes them."""
        drops: list[bytes] = []
        cpu: list[tuple[int, bytes]] = []
        gpu: list[tuple[int, bytes]] = []
        books = self.books
        ranked = sorted(
            chunks, key=lambda c: books.value(c.index, c.users.values(), now), reverse=True
        )
        for chunk in ranked:
            assert chunk.key is not None
            victims = books.admit(chunk, chunk.key, now)
            if victims is None:
                continue
            drops += victims
            if chunk.gpu_block is not None:  # its KV is there whatever copy is pending
                gpu.append((chunk.gpu_block, chunk.key))
            else:
                assert chunk.cpu_slot is not None
                cpu.append((chunk.cpu_slot, chunk.key))
        return drops, cpu, gpu

    def _save(
        self, chunk: Chunk, now: float, cpu_slot: int | None, gpu_block: int | None = None
    ) -> bool:
        """Save the sealed chunk if the books admit it (the removals that make room first)."""
        assert chunk.key is not None
        if not self.copies.can_save(cpu_slot):
            return False
        victims = self.books.admit(chunk, chunk.key, now)
        if victims is None:  # on disk already, writes off, or the disk is full of better ones
            return False
        self.copies.save_to_disk(chunk.key, victims, cpu_slot, gpu_block)
        return True
