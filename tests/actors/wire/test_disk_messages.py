"""The disk tier's messages between a scheduler and the executor of another process: they
round-trip, another version is refused, and a large tier's keys and write-back are cut into
messages within the server's payload limit, in their order."""

from __future__ import annotations

import os

import orjson
import pytest

from pensieve.actors.wire.disk_messages import (
    KeysPage,
    ReadAnswer,
    ReadRequest,
    WriteBackAnswer,
    WriteBackRequest,
    entries_per_message,
    keys_pages,
    write_back_requests,
)
from pensieve.actors.wire.messages import MessageError

MIB = 1 << 20


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_the_messages_round_trip_and_another_version_is_refused() -> None:
    some = keys(3)
    for message in (
        ReadRequest("r-1", some),
        ReadAnswer("r-1", some[:1]),
        KeysPage(some, True),
        WriteBackRequest(some[:1], [(7, some[1])], [(0, some[2])]),
        WriteBackAnswer(2),
    ):
        assert type(message).decode(message.encode()) == message
        with pytest.raises(MessageError, match="schema version 9"):
            type(message).decode(orjson.dumps({**orjson.loads(message.encode()), "v": 9}))


def test_a_write_back_is_cut_in_its_order() -> None:
    drops, cpu, gpu = keys(2), list(enumerate(keys(3))), [(9, k) for k in keys(2)]
    size = 1024 + 64 * 3  # three entries a message
    assert entries_per_message(size) == 3
    parts = list(write_back_requests(drops, cpu, gpu, size))
    assert [(len(p.drops), len(p.cpu), len(p.gpu)) for p in parts] == [
        (2, 1, 0),
        (0, 2, 1),
        (0, 0, 1),
    ]
    assert [k for p in parts for k in p.drops] == drops
    assert [c for p in parts for c in p.cpu] == cpu and [g for p in parts for g in p.gpu] == gpu
    assert list(write_back_requests([], [], [], size)) == [WriteBackRequest([], [], [])]


def test_a_large_tier_s_messages_fit_the_payload_limit() -> None:
    many = keys(40_000)
    places = [(10_000_000 + i, k) for i, k in enumerate(many)]
    parts = list(write_back_requests(many[:5000], places, places[:5000], MIB))
    assert len(parts) > 1 and all(len(p.encode()) <= MIB for p in parts)
    assert sum(len(p.drops) + len(p.cpu) + len(p.gpu) for p in parts) == 50_000
    pages = list(keys_pages(many, MIB))
    assert all(len(p.encode()) <= MIB for p in pages)
    assert [p.more for p in pages] == [True] * (len(pages) - 1) + [False]
    assert [k for p in pages for k in p.keys] == many
    assert list(keys_pages([], MIB)) == [KeysPage([], False)]
