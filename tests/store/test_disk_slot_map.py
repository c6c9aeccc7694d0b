"""The disk tier's slot bookkeeping (pure): free, reserved, held and pinned slots."""

from __future__ import annotations

import pytest

from pensieve.store.disk.layout import Entry
from pensieve.store.disk.slot_map import SlotMap

FP = bytes(16)


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def held(slots: dict[int, int]) -> dict[bytes, Entry]:
    return {key(n): Entry(slot, n, FP) for n, slot in slots.items()}


def test_reserve_takes_the_lowest_free_slots_up_to_the_budget() -> None:
    slots = SlotMap(5, held({1: 0, 2: 3}))
    assert slots.reserve([key(1), key(7), key(8), key(7), key(9), key(10)]) == [
        (key(7), 1),
        (key(8), 2),
        (key(9), 4),
    ]
    assert slots.num_free == 0 and slots.reserve([key(11)]) == []


def test_a_released_reservation_frees_its_slot_and_a_held_one_is_found() -> None:
    slots = SlotMap(2, {})
    (_, a), (_, b) = slots.reserve([key(1), key(2)])
    slots.release([key(1)])
    slots.hold(key(2), Entry(b, 2, FP))
    assert slots.num_free == 1 and key(2) in slots and key(1) not in slots
    assert slots.reserve([key(3)]) == [(key(3), a)]
    with pytest.raises(ValueError, match="was not reserved"):
        slots.hold(key(3), Entry(b, 3, FP))
    slots.hold(key(3), Entry(a, 3, FP))
    assert slots.num_held == 2


def test_a_slot_freed_while_a_read_has_it_pinned_is_reused_only_after_the_read() -> None:
    slots = SlotMap(1, held({1: 0}))
    entry = slots.pin(key(1))
    assert entry is not None
    assert slots.detach([key(1), key(1), key(5)]) == [(key(1), entry)]
    slots.free([entry.slot])
    assert slots.reserve([key(2)]) == []  # the read still has slot 0
    slots.unpin(entry.slot)
    assert slots.reserve([key(2)]) == [(key(2), 0)]


def test_two_chunks_in_one_slot_or_a_slot_past_the_budget_are_refused() -> None:
    with pytest.raises(ValueError, match="slot of its own"):
        SlotMap(4, held({1: 2, 2: 2}))
    with pytest.raises(ValueError, match="slot of its own"):
        SlotMap(4, held({1: 4}))
