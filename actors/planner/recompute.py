"""The recompute planner's core: which positions of a conversation's history are in no tier,
from one engine's KV events (no I/O). The actor shell (`actor.py`) feeds it the event batches and
the conversation's token log, and answers with its plan.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import msgspec

from pensieve.actors.planner.tier_map import SequenceGap, TierMap
from pensieve.actors.wire.messages import KvEventBatch, KvEventKind, RecomputePlan, Tier

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Seen:
    """What events have said about one conversation's chunks since the planner lost track."""

    indices: set[int] = dataclasses.field(default_factory=set)  # placed by an event
    removed_from: int | None = None  # every chunk from this index on was removed


class RecomputePlanner:
    """Which positions of a conversation's history are in no tier, from the engine's KV events.

    A plan is never built from a chunk whose place may have changed unseen:
      - a seq-1 batch (a fresh engine process, whose tiers start empty) makes every chunk known:
        a conversation absent from the map has none anywhere, so all of it is recomputed;
      - before the first batch, and after a gap in seq (a lost batch, or a planner that
        subscribed late), a chunk is known only once an event placed it (each event says where
        its chunk is afterwards) or removed it since. A plan that needs any other chunk is
        unknown until the next seq-1 batch or until events have placed it.
    A restarted engine keeps its id; the planner sees the restart only at its first batch.
    """

    def __init__(self) -> None:
        self.tier_map = TierMap()
        self._seen: dict[str, _Seen] | None = {}  # None: every chunk is known

    @property
    def synced(self) -> bool:
        """Whether every chunk's place is known (since a seq-1 batch, with no gap after it)."""
        return self._seen is None

    def apply(self, batch: KvEventBatch) -> None:
        """Follow one batch of the engine's KV events (batches come in the order published)."""
        try:
            self.tier_map.apply(batch)
        except SequenceGap:
            self._resume(batch)
            return
        if batch.seq == 1:
            self._seen = None
        self._note(batch)

    def plan(
        self, conv_id: str, token_log: Sequence[int], num_positions: int, block_size: int
    ) -> RecomputePlan:
        """Where the KV of the conversation's first `num_positions` positions is, for chunks of
        `block_size` positions. Only the positions before the log's last token have KV: that
        token was sampled, never fed, so it and every position past the log are new."""
        log_len = len(token_log)
        history = min(num_positions, max(log_len - 1, 0))
        num_chunks = -(-history // block_size)
        if not self._knows(conv_id, num_chunks):
            return RecomputePlan(conv_id, False, log_len, history, (), 0, 0, 0)
        tiers = self.tier_map.tiers(conv_id)  # absent: every chunk dropped
        ranges: list[tuple[int, int]] = []
        num_tokens = dict.fromkeys(Tier, 0)
        for i in range(num_chunks):
            start, end = i * block_size, min((i + 1) * block_size, history)
            tier = tiers[i] if i < len(tiers) else Tier.DROPPED
            num_tokens[tier] += end - start
            if tier is Tier.DROPPED:
                _extend(ranges, start, end)
        recomputed, gpu, cpu = (num_tokens[t] for t in (Tier.DROPPED, Tier.GPU, Tier.CPU))
        return RecomputePlan(conv_id, True, log_len, history, tuple(ranges), recomputed, gpu, cpu)

    def _resume(self, batch: KvEventBatch) -> None:
        """After a gap: a map of what `batch` and the batches after it say, and nothing more.
        A batch numbered at or before the last one (a second publisher under this engine's id)
        is not trusted either: the map starts empty after it."""
        ahead = batch.seq > self.tier_map.last_seq
        logger.warning(
            "KV events of engine %s: batch %d after batch %d; plans wait for the "
            "chunks to be placed again",
            batch.engine_id,
            batch.seq,
            self.tier_map.last_seq,
        )
        self.tier_map, self._seen = TierMap(), {}
        if ahead:
            self.tier_map.apply(msgspec.structs.replace(batch, seq=1))  # an empty map, then these
            self._note(batch)
        self.tier_map.last_seq = batch.seq  # the engine's numbering goes on from here

    def _note(self, batch: KvEventBatch) -> None:
        if self._seen is None:
            return
        for event in batch.events:
            seen = self._seen.setdefault(event.conversation_id, _Seen())
            if event.kind is KvEventKind.REMOVED:
                floor = seen.removed_from
                seen.removed_from = event.index if floor is None else min(floor, event.index)
            else:
                seen.indices.add(event.index)

    def _knows(self, conv_id: str, num_chunks: int) -> bool:
        if self._seen is None:
            return True
        seen = self._seen.get(conv_id, _Seen())
        floor = num_chunks if seen.removed_from is None else seen.removed_from
        return all(i in seen.indices for i in range(min(floor, num_chunks)))


def _extend(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """Append [start, end), merged into the last range if it ends at `start`."""
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))
