"""The KV event plane: which chunk of which conversation went where, batched per engine step.

The cache manager records a `KvEvent` whenever a chunk changes place (`Engine.take_kv_events`).
After every step the chat service takes them and
  - publishes them as the next `KvEventBatch` on `pensieve.v1.engine.<id>.kv`, from which a
    subscriber (a cache-aware router, a dashboard) rebuilds with `TierMap` where each
    conversation's KV lives;
  - turns them into the CPU tier's changes for the LMDB spill index (`SpillIndex`).

Every event says where its chunk is afterwards, as the pair (GPU block, CPU slot) the manager
keeps, so applying the events in order gives the manager's own map exactly, whatever their kind.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from pensieve.actors.scheduler.kv.kv_cache import Chunk, Tier
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.wire.messages import KvEvent, KvEventBatch, KvEventKind

Location = tuple[int | None, int | None]  # a chunk's (GPU block, CPU slot); None: not there
TierSnapshot = dict[str, tuple[Location, ...]]  # conversation -> its chunks' locations, in order
SpillChanges = dict[tuple[str, int], int | None]  # (conversation, chunk) -> CPU slot, None: gone


class SequenceGap(Exception):
    """A batch that does not follow the last one applied: the map would be wrong from here."""


class KvEventStream:
    """Stamps each step's events as the next batch of one engine process (seq 1, 2, ...)."""

    def __init__(self, engine_id: str, clock: Callable[[], float] = time.time) -> None:
        self.engine_id = engine_id
        self.clock = clock
        self._seq = itertools.count(1)

    def batch(self, events: Iterable[KvEvent]) -> KvEventBatch:
        return KvEventBatch(self.engine_id, next(self._seq), self.clock(), tuple(events))


class TierMap:
    """Where one engine's conversations keep their chunks, rebuilt from its event batches.

    Batches must come in sequence; one that skips or repeats a number raises SequenceGap and
    changes nothing. Seq 1 means a fresh engine process, whose tiers start empty: the map
    starts over. A conversation without chunks is not in the map.
    """

    def __init__(self) -> None:
        self.engine_id: str | None = None
        self.last_seq = 0
        self._chunks: dict[str, list[Location]] = {}

    def apply(self, batch: KvEventBatch) -> None:
        if self.engine_id not in (None, batch.engine_id):
            raise ValueError(f"a batch of engine {batch.engine_id} for engine {self.engine_id}")
        if batch.seq == 1:
            self._chunks.clear()
        elif batch.seq != self.last_seq + 1:
            missed = batch.seq - self.last_seq - 1
            why = f"{missed} missed" if missed > 0 else "out of order"
            raise SequenceGap(
                f"engine {batch.engine_id}: batch {batch.seq} after batch "
                f"{self.last_seq} ({why}); the map is stale"
            )
        self.engine_id, self.last_seq = batch.engine_id, batch.seq
        for event in batch.events:
            self._apply(event)

    def locations(self, conv_id: str) -> tuple[Location, ...]:
        return tuple(self._chunks.get(conv_id, ()))

    def tiers(self, conv_id: str) -> list[Tier]:
        """Each chunk's tier, as `ConversationKV.tiers` gives it on the engine."""
        return [Chunk(gpu, cpu).tier for gpu, cpu in self._chunks.get(conv_id, ())]

    def snapshot(self) -> TierSnapshot:
        return {conv_id: tuple(chunks) for conv_id, chunks in self._chunks.items()}

    def _apply(self, event: KvEvent) -> None:
        chunks = self._chunks.setdefault(event.conversation_id, [])
        if event.kind is KvEventKind.REMOVED:
            del chunks[event.index :]
        else:
            # a conversation's chunks are created in index order, so this appends at most one
            chunks.extend([(None, None)] * (event.index + 1 - len(chunks)))
            chunks[event.index] = (event.gpu_block, event.cpu_slot)
        if not chunks:
            del self._chunks[event.conversation_id]


def snapshot(kv: KVCacheManager) -> TierSnapshot:
    """The cache manager's own map, in `TierMap.snapshot`'s form (to compare the two)."""
    return {
        conv.conv_id: tuple((chunk.gpu_block, chunk.cpu_slot) for chunk in conv.chunks)
        for conv in kv.conversations.values()
        if conv.chunks
    }


class SpillIndex:
    """Keeps the LMDB spill index (conversation, chunk -> CPU slot) equal to the CPU tier.

    It mirrors what the index holds, so each batch of events becomes only the entries that
    changed, which go to `write` (see `pensieve.store.spill_index.SpillIndexWriter`, which
    applies them off the engine thread). The index starts empty, as the CPU tier does.
    """

    def __init__(self, write: Callable[[SpillChanges], None]) -> None:
        self.write = write
        self._held: dict[str, dict[int, int]] = {}

    def apply(self, events: Iterable[KvEvent]) -> None:
        changes: SpillChanges = {}
        for event in events:
            conv_id = event.conversation_id
            held = self._held.setdefault(conv_id, {})
            if event.kind is KvEventKind.REMOVED:
                for index in [i for i in held if i >= event.index]:
                    del held[index]
                    changes[conv_id, index] = None
            elif event.cpu_slot is None:
                if held.pop(event.index, None) is not None:
                    changes[conv_id, event.index] = None
            elif held.get(event.index) != event.cpu_slot:
                held[event.index] = changes[conv_id, event.index] = event.cpu_slot
            if not held:
                del self._held[conv_id]
        if changes:
            self.write(changes)

    def entries(self) -> dict[str, dict[int, int]]:
        """What the index holds once every write is applied: conversation -> chunk -> slot."""
        return {conv_id: dict(held) for conv_id, held in self._held.items()}
