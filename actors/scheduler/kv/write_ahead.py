"""Chunks saved for the disk tier while they are still on the CPU tier, ahead of their eviction.

A chunk that leaves the CPU tier for the disk is copied out of its slot before the slot is
reused, and the slot is reused in the step that evicts it (the swap-out that needed room): that
copy runs on the executor's thread, on the step's path. A chunk saved earlier, while it still
sits in its slot, is copied by the disk tier's writer thread in the background (`actors/
executor/disk_cache.py`), and its eviction later costs nothing: the disk holds its key already
(`DiskBooks.admit`).

So every chunk that joins the CPU tier (a swap-out, an evict-first copy) is queued; once its copy
has been issued (the step boundary after it joined), up to `PER_STEP` queued chunks a step are
saved, oldest first, if they are still on the CPU tier, sealed, not on disk, and worth a place
there. A slot saved this way that a later step overwrites before the writer copied it is copied
then by the executor, as an evicted one is.
"""

from __future__ import annotations

from collections import deque

from pensieve.actors.scheduler.kv.copies import TierCopies
from pensieve.actors.scheduler.kv.disk_books import DiskBooks
from pensieve.actors.scheduler.kv.kv_cache import Chunk

PER_STEP = 16  # saves a step: a 4 MiB chunk each on an 8B model, ~1 GB/s at 15 ms a step


class WriteAhead:
    def __init__(self) -> None:
        self._joined: list[Chunk] = []  # joined the CPU tier; its copy is in this step's orders
        self._due: deque[Chunk] = deque()  # their copies issued: can be saved
        self.num_saved = 0

    def __len__(self) -> int:
        return len(self._joined) + len(self._due)

    def joined(self, chunk: Chunk) -> None:
        self._joined.append(chunk)

    def step_boundary(self) -> None:
        """The step's orders were taken: the copies of the chunks that joined are issued."""
        self._due.extend(self._joined)
        self._joined.clear()

    def clear(self) -> None:
        self._joined.clear()
        self._due.clear()

    def save(self, books: DiskBooks, copies: TierCopies, now: float) -> int:
        """Order the saves of up to `PER_STEP` due chunks; the number ordered."""
        saved = 0
        while self._due and saved < PER_STEP and books.writable:
            chunk = self._due.popleft()
            slot, key = chunk.cpu_slot, chunk.key
            if slot is None or key is None or key in books or not copies.can_save(slot):
                continue
            victims = books.admit(chunk, key, now)
            if victims is None:  # the disk is full of chunks worth more
                continue
            copies.save_to_disk(key, victims, slot, None)
            saved += 1
        self.num_saved += saved
        return saved
