"""The disk tier's books on the scheduler's side: which content keys it holds, within its budget
of slots, and which of them leaves first when a chunk worth more must be written (pure).

    GPU --evict--> CPU tier --evict--> disk --evict--> dropped (recomputed when needed)

One value ranks every tier: the retention value (`eviction.py`). A chunk on disk is worth what
its users make it worth now, `Cost(l) * sum over them of 1/T` (or their latest activity under
the `lru` policy): the conversations that used it when it was written or that read it back
since, as far as the manager still knows them. A chunk no known conversation uses (one left by a
run before whose conversation has not come back yet, or one of a forgotten conversation) is
worth nothing and leaves first, the oldest first; so does any chunk on a tie. A running
conversation's chunks are worth much (T is short) but not more than any other, unlike on the
GPU, where they cannot leave: on disk they are copies of chunks the GPU holds.

The budget is a hard bound: a chunk is written only into a free slot or in the place of a chunk
worth less, and one worth no more than every chunk on a full disk is not written. The executor's
tier follows the books' orders in one queue, removals before the writes that need their slots,
so it never holds more than they do (it may hold less: a write that failed, a chunk read back
corrupt and dropped); once its writes are off, the books order no more writes nor removals.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from pensieve.actors.scheduler.kv.eviction import EvictionOrder
from pensieve.actors.scheduler.kv.kv_cache import Chunk, ConversationKV


@dataclass
class _OnDisk:
    index: int | None  # the chunk's place in its conversations (None: not known, a run before's)
    users: set[str]  # conversation ids
    age: int  # order of writing (or of reading back): the older goes first on a tie


class DiskBooks:
    def __init__(self, num_slots: int, keys: Iterable[bytes], order: EvictionOrder) -> None:
        self.num_slots = num_slots
        self.order = order
        self.writable = True
        self._ages = itertools.count()
        self._chunks = {key: _OnDisk(None, set(), next(self._ages)) for key in keys}
        # one ranking per `now` (lowest first): value, age, key; stale entries are skipped
        self._ranking: list[tuple[float, int, bytes]] = []
        self._ranked_at: float | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def keys(self) -> list[bytes]:
        return list(self._chunks)

    def value(self, index: int | None, users: Iterable[ConversationKV], now: float) -> float:
        """The retention value of chunk `index` with these users (see the module docstring)."""
        live = {conv.conv_id: conv for conv in users}
        if index is None or not live:
            return 0.0
        return self.order.value(Chunk(index, users=live), now)

    def value_of(self, key: bytes, now: float) -> float:
        """What the chunk of `key` on disk is worth now."""
        held = self._chunks[key]
        known = self.order.conversations
        users = [known[conv_id] for conv_id in held.users if conv_id in known]
        return self.value(held.index, users, now)

    def admit(self, chunk: Chunk, key: bytes, now: float) -> list[bytes] | None:
        """Whether the chunk leaving the tiers above (sealed under `key`) is to be written: the
        keys to remove first to make room (possibly none), or None (not written: writes are off,
        or the disk is full of chunks worth at least as much). A key on disk already is not
        written again; its users are brought up to date."""
        if key in self._chunks:
            self._chunks[key].users.update(chunk.users)
            return None
        if not self.writable:
            return None
        victims = []
        if len(self._chunks) >= self.num_slots:
            lowest = self._lowest(now)
            if lowest is None or lowest[0] >= self.value(chunk.index, chunk.users.values(), now):
                return None
            heapq.heappop(self._ranking)
            victims.append(lowest[2])
            del self._chunks[lowest[2]]
        held = self._chunks[key] = _OnDisk(chunk.index, set(chunk.users), next(self._ages))
        if self._ranked_at == now:
            heapq.heappush(self._ranking, (self.value_of(key, now), held.age, key))
        return victims

    def read_by(self, key: bytes, conv: ConversationKV, index: int) -> None:
        """`conv` loaded the chunk of `key` at `index` (read back for its turn)."""
        held = self._chunks.get(key)
        if held is not None:
            held.index = index
            held.users.add(conv.conv_id)

    def _lowest(self, now: float) -> tuple[float, int, bytes] | None:
        """The chunk on disk worth least now, left in the ranking. The ranking is built once per
        `now`, in O(chunks on disk); within one `now` values change only as turns start, end or
        arrive, and a chunk whose value rose since is ranked again before it is taken."""
        if self._ranked_at != now:
            self._ranking = [(self.value_of(k, now), c.age, k) for k, c in self._chunks.items()]
            heapq.heapify(self._ranking)
            self._ranked_at = now
        while self._ranking:
            value, age, key = self._ranking[0]
            held = self._chunks.get(key)
            if held is None or held.age != age:  # left the disk, or written again since
                heapq.heappop(self._ranking)
                continue
            current = self.value_of(key, now)
            if current != value:
                heapq.heapreplace(self._ranking, (current, age, key))
                continue
            return value, age, key
        return None
