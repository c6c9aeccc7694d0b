"""The KV event plane: which chunk of which conversation went where, batched per engine step.

The cache manager records a `KvEvent` whenever a chunk changes place (`ChunkEvents`, taken by
`Engine.take_kv_events`). After every step the chat service takes them and publishes them as the
next `KvEventBatch` on `pensieve.v1.engine.<id>.kv` (`KvEventStream`). Its followers: the recompute
planner rebuilds where each conversation's KV lives (`pensieve.actors.planner.tier_map.TierMap`),
the executor's spill keeper keeps the LMDB spill index equal to the CPU tier
(`pensieve.actors.executor.spill_keeper`); a cache-aware router or a dashboard can do the same.

Every event says where its chunk is afterwards, as the pair (GPU block, CPU slot) the manager
keeps, so applying the events in order gives the manager's own map exactly, whatever their kind.
A chunk shared by several conversations (`content_index.py`) is named once per user: each of its
moves is an event for every user, and a conversation that comes to use a chunk already cached
gets a STORED event with the chunk's place (GPU block, CPU slot or neither).

Every event also says under which content key its chunk is found afterwards (None: unsealed),
with the key it is chained to (`KvEvent.parent`): a chunk is SEALED when its turn ends, keeps its
key through every move, and is UNSEALED only when a cut history is written into it again. So a
router that applies the batches of many engines knows which engine holds which prefix, and on
which tier (`pensieve.actors.wire.prefix_index.PrefixIndex`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from pensieve.actors.scheduler.kv.kv_cache import Chunk
from pensieve.actors.wire.messages import KvEvent, KvEventBatch, KvEventKind


class ChunkEvents:
    """The cache manager's record of chunk moves, and which chunk owns each GPU block and CPU
    slot, so that an event can name a chunk reached through its block (reclaim, a CPU victim);
    an owner entry counts only while its block is owned."""

    def __init__(self) -> None:
        self.gpu_where: dict[int, Chunk] = {}
        self.cpu_where: dict[int, Chunk] = {}
        self._events: list[KvEvent] | None = None  # None: nobody takes them (see take)

    def take(self) -> list[KvEvent]:
        """The events since the last call, in order. Recording starts with the first call (a
        cache nobody takes events from keeps none): make it before anything is cached."""
        events, self._events = self._events or [], []
        return events

    def emit(self, kind: KvEventKind, chunk: Chunk) -> None:
        """Record that the chunk changed (`kind`) and is now where it says, for each user."""
        if self._events is not None:
            for conv_id in chunk.users:
                self._events.append(_event(kind, conv_id, chunk))

    def emit_for(self, kind: KvEventKind, conv_id: str, chunk: Chunk) -> None:
        """Record the chunk's change (`kind`) for one of its users only."""
        if self._events is not None:
            self._events.append(_event(kind, conv_id, chunk))

    def removed(self, conv_id: str, index: int) -> None:
        """Record that the conversation's chunks from `index` on are gone."""
        if self._events is not None:
            self._events.append(KvEvent(KvEventKind.REMOVED, conv_id, index))


def _event(kind: KvEventKind, conv_id: str, chunk: Chunk) -> KvEvent:
    """The event of a user of the chunk; a sealed chunk's names its key and its parent's (each
    user's keys lead up to the chunk's, so any user's give the same parent): the key before it,
    or for chunk 0 the seed its key is chained from (`Namespace.first_parent`)."""
    key = parent = None
    if chunk.key is not None:
        user = chunk.users[conv_id]
        key = chunk.key
        parent = user.keys[chunk.index - 1] if chunk.index else user.namespace.first_parent(key)
    return KvEvent(kind, conv_id, chunk.index, chunk.gpu_block, chunk.cpu_slot, key, parent)


class KvEventStream:
    """Stamps each step's events as the next batch of one engine process (seq 1, 2, ...)."""

    def __init__(self, engine_id: str, clock: Callable[[], float] = time.time) -> None:
        self.engine_id = engine_id
        self.clock = clock
        self._seq = itertools.count(1)

    def batch(self, events: Iterable[KvEvent]) -> KvEventBatch:
        return KvEventBatch(self.engine_id, next(self._seq), self.clock(), tuple(events))
