"""Writes the CPU tier's changes into the store's spill index, off the engine's step loop.

The engine thread hands over each step's changes ((conversation, chunk) -> CPU slot, None for
gone) and carries on. They are applied on the `StoreWriter` thread, in one LMDB transaction per
write, and at most one spill write waits in the writer's queue at a time: changes that come while
it waits join it. Turn commits share that queue and their replies wait for them, so however
fast steps come, the spill index never adds more than one write ahead of a turn.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from pensieve.store.conversation_store import ConversationStore
from pensieve.store.writer import StoreWriter


class SpillIndexWriter:
    def __init__(self, store: ConversationStore, writer: StoreWriter) -> None:
        self.store = store
        self.writer = writer
        self._lock = threading.Lock()  # the engine thread adds, the writer thread takes
        self._pending: dict[tuple[str, int], int | None] = {}
        self._queued = False  # a write is in the writer's queue and has not taken `_pending` yet

    def update(self, changes: Mapping[tuple[str, int], int | None]) -> None:
        """Set each (conversation, chunk) entry to its CPU slot, or remove it (None)."""
        if not changes:
            return
        with self._lock:
            self._pending.update(changes)  # a later change of an entry replaces an earlier one
            if self._queued:
                return
            self._queued = True
        self.writer.submit(self._write)

    def _write(self) -> None:  # on the writer thread
        with self._lock:
            pending, self._pending = self._pending, {}
            self._queued = False
        puts = [(conv, index, slot) for (conv, index), slot in pending.items() if slot is not None]
        removes = [key for key, slot in pending.items() if slot is None]
        self.store.update_spills(puts, removes)
