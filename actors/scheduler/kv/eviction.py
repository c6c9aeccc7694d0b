"""Which chunks leave a tier first: the retention value and the eviction order (pure).

Retention value of a chunk (DESIGN.md §3): `V = Cost(l) * sum over its users of 1/T`, `l` the
context its last position attends to, `T` the time since that user was last active. Under the
`lru` policy the value is its users' latest activity instead. The lowest value goes first:
GPU -> CPU (swap-out), CPU -> dropped.

A chunk of one conversation alone (its own) is worth `Cost(l) / T`: within the conversation
values grow with the chunk index, and on a tie the leading chunk goes first, so a conversation
gives up its own chunks from their leading end. A shared chunk (a common prefix, see
`content_index.py`) is worth the sum over its users, which may be more than the chunks after it
in any one of them: `Cost(l_i) (1/T_a + 1/T_b)` against `Cost(l_{i+1}) / T_a`, so a prefix many
conversations use outlives the private tails of the idle ones, as a radix cache keeps a prefix
while its leaves go. So with sharing a conversation's dropped chunks need not be a leading run
(any dropped range is recomputed alike); what holds is that every eviction takes the chunk of
lowest value at that moment.

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
    """`chunk`, worth `value`; `tie` orders equal values (the waiting turns', all infinite: the
    latest arrival first). `conv` is its user (the first one, if it is shared)."""

    value: float
    tie: float
    chunk: Chunk
    conv: ConversationKV

    @property
    def index(self) -> int:
        return self.chunk.index

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
        shared: dict[int, Chunk] | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.conversations = conversations
        self.reclaiming = reclaiming
        self.shared: dict[int, Chunk] = {} if shared is None else shared  # read live
        self._cpu: Ranking | None = None  # the CPU tier's ranking in the current operation
        # when a swap-out was last blocked, and the GPU's free count then (see RETRY_S)
        self._blocked: tuple[float, int] | None = None

    def value(self, chunk: Chunk, now: float) -> float:
        """Retention value: lowest is evicted first (leading chunks of idle conversations)."""
        users = chunk.users.values()
        if self.config.policy is Policy.LRU:
            return max(user.last_active for user in users)
        end = (chunk.index + 1) * self.config.block_size
        if len(chunk.users) == 1:
            (conv,) = users
            context = min(end, max(conv.num_positions, 1))
            return self.cost(context) / max(now - conv.last_active, 1e-6)
        # a shared chunk is full in every user
        return self.cost(end) * sum(1 / max(now - user.last_active, 1e-6) for user in users)

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

    def joined_cpu(self, chunk: Chunk) -> None:
        """The chunk was just swapped out or evicted to the CPU tier."""
        if self._cpu is not None:
            self._cpu.join(chunk)

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
            return self._cpu.leading(incoming.conv, before=incoming.index)
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
# number, the chunk, and the conversation whose next own chunk of the tier follows it (None: a
# chunk ranked alone)
_Entry = tuple[float, float, int, int, int, Chunk, ConversationKV | None]


class Ranking:
    """One operation's ranking of one tier's unpinned chunks, lowest first, kept current: a chunk
    that leaves the tier is skipped, one that joins it (`join`) takes its place at once.

    Values are fixed within an operation (one `now`), and within a conversation its own chunks'
    values grow with the chunk index. So the heap holds, per conversation, one entry for its
    leading own chunk of the tier, which is replaced by the next one as it goes (a chain), plus an
    entry for each shared chunk of the tier and each chunk that joined the tier since: the lowest
    entry is always the lowest chunk. Building it reads every conversation and shared chunk once;
    each victim then costs a heap operation, and each chain reads its conversation's chunks once,
    so a pass stays O((C + S + k) log (C + S)) for C conversations, S shared chunks and k moves.

    Chunks of conversations with a turn waiting for admission come after all the others,
    whatever the policy: the latest arrival first (it is admitted last), each from its leading
    chunk, at an infinite value (so no ahead-of-time swap-out drops them from the CPU tier).
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
            first = self._next_own(conv, 0)
            if first is not None:
                self._heap.append(self._entry(first, chain=conv))
            elif on_gpu:  # an own live GPU chunk of an idle conversation appears only through
                conv.maybe_on_gpu = False  # acquire / grow / unsharing, which set the hint again
            else:
                conv.maybe_on_cpu = any(c.cpu_slot is not None for c in conv.chunks)
        for chunk in order.shared.values():
            if not chunk.pins and order.on_tier(chunk, tier):
                self._heap.append(self._entry(chunk, chain=None))
        heapq.heapify(self._heap)

    def join(self, chunk: Chunk) -> None:
        heapq.heappush(self._heap, self._entry(chunk, chain=None))

    def lowest(self) -> Candidate | None:
        """The lowest chunk still on the tier, left in the ranking."""
        while self._heap:
            value, tie, _, _, _, chunk, _ = self._heap[0]
            if not chunk.pins and self.order.on_tier(chunk, self.tier):
                return Candidate(value, tie, chunk, next(iter(chunk.users.values())))
            self._take_top()
        return None

    def leading(self, conv: ConversationKV, before: int) -> Chunk | None:
        """`conv`'s first own chunk on the tier, if it comes before chunk `before` (the ranking
        skips it once it has left the tier)."""
        chunk = self._next_own(conv, 0)
        return chunk if chunk is not None and chunk.index < before else None

    def pop(self) -> Candidate | None:
        """The lowest chunk still on the tier, taken out of the ranking."""
        lowest = self.lowest()
        if lowest is not None:
            self._take_top()
        return lowest

    def _take_top(self) -> None:
        _, _, index, _, _, _, conv = heapq.heappop(self._heap)
        if conv is not None and not conv.pinned:  # the conversation's next chunk takes its place
            following = self._next_own(conv, index + 1)
            if following is not None:
                heapq.heappush(self._heap, self._entry(following, chain=conv))

    def _next_own(self, conv: ConversationKV, start: int) -> Chunk | None:
        """The conversation's first chunk from `start` on that is its own and on the tier."""
        chunks = conv.chunks
        for index in range(start, len(chunks)):
            if len(chunks[index].users) == 1 and self.order.on_tier(chunks[index], self.tier):
                return chunks[index]
        return None

    def _entry(self, chunk: Chunk, chain: ConversationKV | None) -> _Entry:
        self._count += 1
        users = chunk.users.values()
        rank = min(self._rank.get(user.conv_id, len(self._rank)) for user in users)
        waiting = [user.waiting_since for user in users if user.waiting_since is not None]
        if waiting:  # read as soon as its first waiting user is admitted
            return (math.inf, -min(waiting), chunk.index, rank, self._count, chunk, chain)
        value = self.order.value(chunk, self.now)
        return (value, 0.0, chunk.index, rank, self._count, chunk, chain)
