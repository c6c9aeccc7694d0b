"""Which chunks leave a tier first: the retention value and the eviction order (pure).

Retention value of a chunk (DESIGN.md §3): `V = Cost(l) * sum over its users of 1/T`, `l` the
context its last position attends to, `T` the time since that user was last active. A chunk here
has one user, its conversation, so `V = Cost(l) / T`. Under the `lru` policy the value is the
conversation's last activity instead (the leading chunk first on a tie). The lowest value goes
first: GPU -> CPU (swap-out), CPU -> dropped. Within a conversation values grow with the chunk
index, so a conversation is evicted from its leading end.

The order only ranks; the cache manager (`kv_manager.py`) moves the chunks and keeps the books.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.scheduler.kv.kv_cache import Chunk, ConversationKV
from pensieve.actors.wire.messages import Tier

# seconds to recompute one chunk whose last position attends to l positions (its retention cost)
CostFn = Callable[[int], float]
# seconds a swap-out blocked by a CPU tier of higher-valued chunks waits before it is tried again
# (sooner if the GPU's free count drops): values change only as idle time grows
RETRY_S = 0.1
Candidate = tuple[float, ConversationKV, Chunk]  # a chunk's value, its conversation, the chunk


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
        self._cpu_victims: Iterator[Candidate] | None = None
        self._cpu_victim_next: Candidate | None = None
        # when a swap-out was last blocked, and the GPU's free count then (see RETRY_S)
        self._blocked: tuple[float, int] | None = None

    def value(self, conv: ConversationKV, index: int, now: float) -> float:
        """Retention value: lowest is evicted first (leading chunks of idle conversations)."""
        if self.config.policy is Policy.LRU:
            return conv.last_active + index * 1e-9
        context = min((index + 1) * self.config.block_size, max(conv.num_positions, 1))
        idle = max(now - conv.last_active, 1e-6)
        return self.cost(context) / idle

    def gpu_candidates(self, now: float) -> Iterator[Candidate]:
        """Unpinned chunks that hold a GPU block and no CPU copy, lowest value first."""
        return self._candidates(now, Tier.GPU)

    def cpu_candidates(self, now: float) -> Iterator[Candidate]:
        """Unpinned chunks that hold a CPU slot and no GPU block, lowest value first."""
        return self._candidates(now, Tier.CPU)

    # ---- the CPU tier's victims ----------------------------------------------------------

    def start_operation(self) -> None:
        """A cache operation begins: the CPU tier is ranked afresh at its first victim."""
        self._cpu_victims = None

    def cpu_victim(self, value: float | None, now: float) -> Chunk | None:
        """The lowest-valued chunk that lives on the CPU tier only, if it is worth less than
        `value` (any, if value is None); None if there is none. One ranking serves a whole
        operation, consumed as it goes; a victim worth too much is kept for a later ask."""
        if self._cpu_victims is None:
            self._cpu_victims = self.cpu_candidates(now)
            self._cpu_victim_next = None
        victim = self._cpu_victim_next or next(self._cpu_victims, None)
        self._cpu_victim_next = None
        while victim is not None:
            victim_value, _, chunk = victim
            if chunk.cpu_slot is not None and chunk.gpu_block is None:
                if value is not None and victim_value >= value:
                    self._cpu_victim_next = victim  # keep it for a later, higher-valued ask
                    return None
                return chunk
            victim = next(self._cpu_victims, None)  # moved since it was ranked
        return None

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

    # ---- the ranking -----------------------------------------------------------------------

    def _candidates(self, now: float, tier: Tier) -> Iterator[Candidate]:
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
                return chunk.gpu_block is not None and not self.reclaiming(chunk)
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
            heap.append((self.value(conv, first, now), first, order, conv, indices))
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
                entry = (self.value(conv, following, now), following, order, conv, indices)
                heapq.heappush(heap, entry)
        waiting.sort(key=lambda c: c.waiting_since or 0.0, reverse=True)
        for conv in waiting:
            for index in eligible(conv):
                if conv.pinned or conv.waiting_since is None:
                    break  # admitted (or released) meanwhile
                yield math.inf, conv, conv.chunks[index]
