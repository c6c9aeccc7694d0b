"""The swap manager's CPU-tier spill index in LMDB: (conversation, chunk) -> CPU slot of every
chunk in the CPU tier, kept from the engine's KV events by the side that holds the tier.

The executor actor follows the KV event plane (`pensieve.v1.engine.<id>.kv`) with one; with the
model in the engine's thread (`--step-channel direct`) the engine hands it each step's events
itself (`Engine.follow_kv_events`). Either way its writes go to a `StoreWriter` thread, batched
(`SpillIndexWriter`), never on a step's path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from pensieve.actors.wire.messages import KvEvent, KvEventBatch, KvEventKind
from pensieve.store import ConversationStore, StoreWriter
from pensieve.store.spill_index import SpillIndexWriter

logger = logging.getLogger(__name__)
SpillChanges = dict[tuple[str, int], int | None]  # (conversation, chunk) -> CPU slot, None: gone


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


class SpillKeeper:
    """Keeps the store's spill index equal to the CPU tier.

    It starts empty, as the tier of an executor that starts does, and starts over (empty)
    whenever the batches it follows do: at batch 1 (a scheduler that started afresh forgets
    every chunk) and after a gap in their numbering (a missed batch would leave entries that
    lie; an entry missing costs only a lookup that finds nothing, until its chunk moves again).
    """

    def __init__(self, store: ConversationStore, writer: StoreWriter) -> None:
        self.store = store
        self.writer = writer
        self.last_seq: int | None = None  # the last batch applied (None: none since the start)
        self._index = self._start_over()

    def apply(self, events: Iterable[KvEvent]) -> None:
        """Events from the engine of this thread, in order (no batch numbers to check)."""
        self._index.apply(events)

    def apply_batch(self, batch: KvEventBatch) -> None:
        """The next batch of the KV event plane."""
        if self.last_seq is not None and batch.seq != self.last_seq + 1:
            if batch.seq != 1:
                logger.warning(
                    "KV events of engine %s: batch %d after batch %d; the spill index starts over",
                    batch.engine_id,
                    batch.seq,
                    self.last_seq,
                )
            self._index = self._start_over()
        self.last_seq = batch.seq
        self._index.apply(batch.events)

    def entries(self) -> dict[str, dict[int, int]]:
        """What the index holds once every write is applied: conversation -> chunk -> slot."""
        return self._index.entries()

    def _start_over(self) -> SpillIndex:
        # a writer of its own: changes still pending in the old one go before the clear
        self.writer.submit(self.store.clear_spills)
        return SpillIndex(SpillIndexWriter(self.store, self.writer).update)
