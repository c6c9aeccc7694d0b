"""Which chunks leave a tier first: the retention value and the eviction order (pure).

Retention value of a chunk (DESIGN.md §3): `V = Cost(l) * sum over its users of 1/T`, `l` the
context its last position attends to, `T` the time since that user was last active. A chunk here
has one user, its conversation, so `V = Cost(l) / T`. Under the `lru` policy the value is the
conversation's last activity instead. The lowest value goes first: GPU -> CPU (swap-out),
CPU -> dropped; within a conversation values grow with the chunk index, and on a tie the leading
chunk goes first, so a conversation is evicted from its leading end.

The CPU tier here holds every chunk whose KV survives only in its CPU slot: those off the GPU, and
those swapped out whose GPU block waits for reuse (dropping one frees its block too). Chunks with
a live GPU block and a valid CPU copy ("backed") are not in it: the manager gives their copies up
first, which loses nothing.

The order only ranks; the cache manager (`kv_manager.py`) moves the chunks and keeps the books.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.scheduler.kv.kv_cache import Chunk, ConversationKV
from pensieve.actors.wire.messages import Tier

# seconds to recompute one chunk whose last position attends to l positions (its retention cost)
CostFn = Callable[[int], float]
# seconds a swap-out blocked by a CPU tier of higher-valued chunks waits before it is tried again
# (sooner if the GPU's free count drops): values change only as idle time grows
RETRY_S = 0.1


@dataclass(frozen=True, eq=False)
class Candidate:
    """Chunk `index` of `conv`, worth `value`; `tie` orders equal values (the waiting turns',
    all infinite: the latest arrival first)."""

    value: float
    tie: float
    conv: ConversationKV
    index: int

    @property
    def chunk(self) -> Chunk:
        return self.conv.chunks[self.index]

    def goes_before(self, other: Candidate) -> bool:
        """Ranks lower: worth less, or worth as much and an earlier chunk of the same
        conversation (chunks of other conversations worth as much stay where they are)."""
        if (self.value, self.tie) != (other.value, other.tie):
            return (self.value, self.tie) < (other.value, other.tie)
        return self.conv is other.conv and self.index < other.index


class EvictionOrder:
    """Ranks the unpinned chunks of `conversations` (the manager's own dict, read live) by
    retention value. `reclaiming` says whether a chunk's GPU block was swapped out already and
    only waits for reuse (such a chunk has nothing left to evict from the GPU)."""

    def __init__(
        self,
        config: CacheConfig,
        cost: CostFn,
        conversations: dict[str, ConversationKV],
        reclaiming: Callable[[Chunk], bool],
    ) -> None:
        self.config = config
        self.cost = cost
        self.conversations = conversations
        self.reclaiming = reclaiming
        self._cpu: Ranking | None = None  # the CPU tier's ranking in the current operation
        # when a swap-out was last blocked, and the GPU's free count then (see RETRY_S)
        self._blocked: tuple[float, int] | None = None

    def value(self, conv: ConversationKV, index: int, now: float) -> float:
        """Retention value: lowest is evicted first (leading chunks of idle conversations)."""
        if self.config.policy is Policy.LRU:
            return conv.last_active
        context = min((index + 1) * self.config.block_size, max(conv.num_positions, 1))
        idle = max(now - conv.last_active, 1e-6)
        return self.cost(context) / idle

    def on_tier(self, chunk: Chunk, tier: Tier) -> bool:
        """Whether the chunk can be evicted from `tier` (see the module docstring)."""
        if tier is Tier.GPU:  # a live GPU copy (not already swapped out and waiting for reuse)
            return chunk.gpu_block is not None and not self.reclaiming(chunk)
        return chunk.cpu_slot is not None and (chunk.gpu_block is None or self.reclaiming(chunk))

    def gpu_candidates(self, now: float) -> Iterator[Candidate]:
        """Unpinned chunks with a live GPU block, lowest first."""
        ranking = Ranking(self, Tier.GPU, now)
        while (candidate := ranking.pop()) is not None:
            yield candidate

    # ---- the CPU tier's victims ----------------------------------------------------------

    def start_operation(self) -> None:
        """A cache operation begins: the CPU tier is ranked afresh at its first victim."""
        self._cpu = None

    def joined_cpu(self, conv: ConversationKV, index: int) -> None:
        """Chunk `index` of `conv` was just swapped out or evicted to the CPU tier."""
        if self._cpu is not None:
            self._cpu.join(conv, index)

    def cpu_victim(
        self, incoming: Candidate | None, now: float, ahead: bool = False
    ) -> Chunk | None:
        """The CPU tier's lowest chunk now, if it goes before `incoming` (any, if None); None if
        there is none. One ranking serves a whole operation and follows every move in it.

        Ahead of time (`ahead`) a swap-out could also wait, so it drops only a chunk worth less
        than `incoming` (never a waiting turn's) and off the GPU: it stops rather than drop one
        whose GPU block still waits for reuse, often one that the same pass has just copied out."""
        if self._cpu is None or self._cpu.now != now:
            self._cpu = Ranking(self, Tier.CPU, now)
        lowest = self._cpu.lowest()
        if lowest is None:
            return None
        if incoming is not None and ahead:
            if not (lowest.value < incoming.value and lowest.chunk.gpu_block is None):
                return None
        elif incoming is not None and not lowest.goes_before(incoming):
            # the lowest is another conversation's, worth as much: the incoming chunk's own
            # conversation still gives up an earlier chunk of the tier, if it has one
            own = self._cpu.leading(incoming.conv, before=incoming.index)
            return None if own is None else incoming.conv.chunks[own]
        self._cpu.pop()
        return lowest.chunk

    # ---- ahead-of-time swap-out ------------------------------------------------------------

    def swap_out_due(self, now: float, num_free_gpu: int) -> bool:
        """Whether an ahead-of-time swap-out is worth trying: not within RETRY_S of a blocked
        one, unless the GPU's free count dropped since."""
        if self._blocked is not None:
            since, free = self._blocked
            if now - since < RETRY_S and num_free_gpu >= free:
                return False
        self._blocked = None
        return True

    def swap_out_blocked(self, now: float, num_free_gpu: int) -> None:
        """The CPU tier held only chunks worth more than the next one to swap out."""
        self._blocked = (now, num_free_gpu)


# a heap entry: value, tie (waiting turns: latest first), index, conversation order, a unique
# number, the conversation, whether it continues to the conversation's next chunk of the tier
_Entry = tuple[float, float, int, int, int, ConversationKV, bool]


class Ranking:
    """One operation's ranking of one tier's unpinned chunks, lowest first, kept current: a chunk
    that leaves the tier is skipped, one that joins it (`join`) takes its place at once.

    Values are fixed within an operation (one `now`), and within a conversation they grow with
    the chunk index. So the heap holds, per conversation, one entry for its leading chunk of the
    tier, which is replaced by the next one as it goes (a chain), plus an entry for each chunk
    that joined the tier since: the lowest entry is always the lowest chunk. Building it reads
    every conversation once; each victim then costs a heap operation, and each chain reads its
    conversation's chunks once, so a pass stays O((C + k) log C) for C conversations and k moves.

    Conversations with a turn waiting for admission come after all the others, whatever the
    policy: the latest arrival first (it is admitted last), each from its leading chunk, at an
    infinite value (so no ahead-of-time swap-out drops them from the CPU tier).
    """

    def __init__(self, order: EvictionOrder, tier: Tier, now: float) -> None:
        self.order, self.tier, self.now = order, tier, now
        self._heap: list[_Entry] = []
        self._rank: dict[str, int] = {}
        self._count = 0
        on_gpu = tier is Tier.GPU
        for rank, conv in enumerate(order.conversations.values()):
            self._rank[conv.conv_id] = rank
            if conv.pinned or not (conv.maybe_on_gpu if on_gpu else conv.maybe_on_cpu):
                continue
            first = self._next_index(conv, 0)
            if first is not None:
                self._heap.append(self._entry(conv, first, chain=True))
            elif on_gpu:  # a live GPU chunk of an idle conversation appears only through
                conv.maybe_on_gpu = False  # acquire / grow, which set the hint again
            else:
                conv.maybe_on_cpu = any(c.cpu_slot is not None for c in conv.chunks)
        heapq.heapify(self._heap)

    def join(self, conv: ConversationKV, index: int) -> None:
        heapq.heappush(self._heap, self._entry(conv, index, chain=False))

    def lowest(self) -> Candidate | None:
        """The lowest chunk still on the tier, left in the ranking."""
        while self._heap:
            value, tie, index, _, _, conv, _ = self._heap[0]
            if not conv.pinned and self._holds(conv, index):
                return Candidate(value, tie, conv, index)
            self._take_top()
        return None

    def leading(self, conv: ConversationKV, before: int) -> int | None:
        """The index of `conv`'s first chunk on the tier, if it comes before `before` (the
        ranking skips it once it has left the tier)."""
        index = self._next_index(conv, 0)
        return index if index is not None and index < before else None

    def pop(self) -> Candidate | None:
        """The lowest chunk still on the tier, taken out of the ranking."""
        lowest = self.lowest()
        if lowest is not None:
            self._take_top()
        return lowest

    def _take_top(self) -> None:
        _, _, index, _, _, conv, chain = heapq.heappop(self._heap)
        if chain and not conv.pinned:  # the conversation's next chunk takes its place
            following = self._next_index(conv, index + 1)
            if following is not None:
                heapq.heappush(self._heap, self._entry(conv, following, chain=True))

    def _holds(self, conv: ConversationKV, index: int) -> bool:
        return index < len(conv.chunks) and self.order.on_tier(conv.chunks[index], self.tier)

    def _next_index(self, conv: ConversationKV, start: int) -> int | None:
        for index in range(start, len(conv.chunks)):
            if self.order.on_tier(conv.chunks[index], self.tier):
                return index
        return None

    def _entry(self, conv: ConversationKV, index: int, chain: bool) -> _Entry:
        self._count += 1
        rank = self._rank.get(conv.conv_id, len(self._rank))
        if conv.waiting_since is not None:
            return (math.inf, -conv.waiting_since, index, rank, self._count, conv, chain)
        return (self.order.value(conv, index, self.now), 0.0, index, rank, self._count, conv, chain)
