"""Where one engine's conversations keep their chunks, rebuilt from its KV event batches.

Every event says where its chunk is afterwards, as the pair (GPU block, CPU slot) the engine's
cache manager keeps, so applying the events in order gives the manager's own map exactly,
whatever their kind. The recompute planner (`recompute.py`) plans from this map.
"""

from __future__ import annotations

from pensieve.actors.wire.messages import KvEvent, KvEventBatch, KvEventKind, Tier, tier_of

Location = tuple[int | None, int | None]  # a chunk's (GPU block, CPU slot); None: not there
TierSnapshot = dict[str, tuple[Location, ...]]  # conversation -> its chunks' locations, in order


class SequenceGap(Exception):
    """A batch that does not follow the last one applied: the map would be wrong from here."""


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
        return [tier_of(gpu, cpu) for gpu, cpu in self._chunks.get(conv_id, ())]

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
