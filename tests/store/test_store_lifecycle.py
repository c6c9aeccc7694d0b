"""A conversation's lifecycle in the store (real LMDB in tmp_path): how it was made and whether it
ended are kept in its meta (metas written before those fields read as neither), an ended one
takes no more turns, `select` finds the ones a sweep deletes, and deleting as fast as writing
keeps the store's used pages bounded."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from pensieve.store import ConversationStore, codec
from tests.store.test_conversation_store import make_turn


def test_how_a_conversation_was_made_is_kept_from_its_first_turn(tmp_path: Path) -> None:
    with ConversationStore(tmp_path) as store:
        assert store.commit_turn("s", make_turn(0), 0, [1, 2], stateless=True).stateless
        assert store.commit_turn("s", make_turn(1), 2, [3], stateless=False).stateless
        assert not store.commit_turn("c", make_turn(0), 0, [1]).stateless
    with ConversationStore(tmp_path) as store:  # durable
        meta = store.meta("s")
        assert meta is not None and meta.stateless and not meta.ended


def test_a_final_turn_ends_the_conversation_for_good(tmp_path: Path) -> None:
    with ConversationStore(tmp_path) as store:
        store.commit_turn("c", make_turn(0), 0, [1, 2])
        assert store.commit_turn("c", make_turn(1), 2, [3], final=True).ended
    with ConversationStore(tmp_path) as store:
        meta = store.meta("c")
        assert meta is not None and meta.ended and meta.num_turns == 2
        with pytest.raises(ValueError, match="has ended"):
            store.commit_turn("c", make_turn(2), 3, [4])
        assert [t.turn for t in store.turns("c")] == [0, 1]


def test_a_meta_written_before_the_lifecycle_fields_reads_as_open_and_stateful() -> None:
    old = {
        "conversation_id": "c",
        "created_at": 1.0,
        "last_active": 2.0,
        "num_turns": 1,
        "log_len": 3,
    }
    meta = codec.decode_meta(orjson.dumps(old))
    assert (meta.stateless, meta.ended) == (False, False)


def test_select_finds_the_conversations_a_sweep_deletes(tmp_path: Path) -> None:
    with ConversationStore(tmp_path) as store:
        for i in range(6):
            store.commit_turn(f"c{i}", make_turn(0, finished_at=2000.0 + i), 0, [i])
        old = store.select(lambda meta: meta.last_active < 2003.0, limit=10)
        assert sorted(old) == ["c0", "c1", "c2"]
        assert len(store.select(lambda meta: True, limit=4)) == 4


def fill_and_delete(store: ConversationStore, cycle: int, delete: bool) -> None:
    """Twenty conversations of about 6 kB each (a stateless client's), then deleted."""
    ids = [f"c{cycle}-{i}" for i in range(20)]
    for conv_id in ids:
        record = make_turn(0, user_message="x" * 2000, assistant_text="y" * 2000)
        store.commit_turn(conv_id, record, 0, list(range(500)), stateless=True)
    for conv_id in ids if delete else ():
        store.delete(conv_id)


def test_deleting_as_fast_as_writing_keeps_the_used_pages_bounded(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "swept") as store:
        used = []
        for cycle in range(30):
            fill_and_delete(store, cycle, delete=True)
            used.append(store.used_bytes())
        assert store.list_conversations() == []
        # freed pages are reused: after the first cycles, twenty more grow the store by less
        # than a tenth of one cycle's pages (LMDB's free-page list itself creeps by a page or two)
        assert used[-1] - used[9] < used[0] / 10, used
    with ConversationStore(tmp_path / "kept") as store:
        for cycle in range(5):
            fill_and_delete(store, cycle, delete=False)
        # what is kept grows (so the bound above comes from the deletes)
        assert store.used_bytes() > 3 * used[-1]
