"""A pool of fixed-size KV blocks (GPU blocks or CPU slots), identified by integer ids."""

from __future__ import annotations

import heapq


class BlockPool:
    """Free-list allocator. Invariant: every id in [0, capacity) is free or owned, never both.

    Allocation hands out the lowest free ids first, so blocks allocated together tend to be
    consecutive and swaps can copy them as one run.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[int] = list(range(capacity))  # a min-heap
        self._is_free = [True] * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        block = heapq.heappop(self._free)
        self._is_free[block] = False
        return block

    def free(self, block: int) -> None:
        if self._is_free[block]:
            raise AssertionError(f"double free of block {block}")
        self._is_free[block] = True
        heapq.heappush(self._free, block)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]
