"""Which chunk each slot of the disk tier holds and which slots are free (pure bookkeeping).

Every slot is in one state at a time:

    free --reserve--> reserved --hold--> held --detach--> (retired) --free--> free
                         |                                     ^
                         +---------------release---------------+ (its write failed)

A reserved slot is being written and no entry names it; a held slot is named by its key's
entry in the index; a detached slot's entry is being removed from the index. A slot becomes
free only once the index no longer names it (`free` is called after the removal commits) and no
read has it pinned, so a slot that an index entry names is never overwritten.
"""

from __future__ import annotations

from collections.abc import Iterable

from pensieve.store.disk.layout import Entry


class SlotMap:
    def __init__(self, num_slots: int, held: dict[bytes, Entry]) -> None:
        used = {entry.slot for entry in held.values()}
        if len(used) != len(held) or any(not 0 <= slot < num_slots for slot in used):
            raise ValueError("every held chunk needs a slot of its own, within the slots")
        self.num_slots = num_slots
        self._held = dict(held)
        # a stack whose top is the lowest slot: a fresh tier fills its file from the start
        self._free = [slot for slot in reversed(range(num_slots)) if slot not in used]
        self._reserved: dict[bytes, int] = {}
        self._pins: dict[int, int] = {}  # slot -> reads in flight
        self._retired: set[int] = set()  # freed while pinned: free once the reads finish

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def __contains__(self, key: bytes) -> bool:
        return key in self._held

    def keys(self) -> list[bytes]:
        return list(self._held)

    def get(self, key: bytes) -> Entry | None:
        return self._held.get(key)

    def reserve(self, keys: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """A free slot for each key neither held nor being written, in order, while slots are
        free (the budget is a hard bound: the rest get none)."""
        reserved = []
        for key in keys:
            if not self._free:
                break
            if key not in self._held and key not in self._reserved:
                slot = self._reserved[key] = self._free.pop()
                reserved.append((key, slot))
        return reserved

    def release(self, keys: Iterable[bytes]) -> None:
        """Reserved slots whose writes did not make it back to free."""
        for key in keys:
            self._free.append(self._reserved.pop(key))

    def hold(self, key: bytes, entry: Entry) -> None:
        """A reserved slot now named by `key`'s committed entry."""
        if self._reserved.get(key) != entry.slot:
            raise ValueError(f"slot {entry.slot} was not reserved for this chunk")
        del self._reserved[key]
        self._held[key] = entry

    def pin(self, key: bytes) -> Entry | None:
        """`key`'s entry, its slot kept from reuse until `unpin` (None: not held)."""
        entry = self._held.get(key)
        if entry is not None:
            self._pins[entry.slot] = self._pins.get(entry.slot, 0) + 1
        return entry

    def unpin(self, slot: int) -> None:
        left = self._pins.pop(slot) - 1
        if left:
            self._pins[slot] = left
        elif slot in self._retired:
            self._retired.remove(slot)
            self._free.append(slot)

    def detach(self, keys: Iterable[bytes]) -> list[tuple[bytes, Entry]]:
        """Stop holding these keys (those held), whose entries the caller then removes from
        the index before it calls `free` with their slots."""
        return [(key, self._held.pop(key)) for key in dict.fromkeys(keys) if key in self._held]

    def free(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if slot in self._pins:
                self._retired.add(slot)
            else:
                self._free.append(slot)
