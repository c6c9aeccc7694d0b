"""ConversationStore on a real LMDB in tmp_path, reopened in fresh processes where it matters."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import orjson
import pytest

from pensieve.store import ConversationStore, TurnRecord, codec


def make_turn(turn: int, output: tuple[int, ...] = (7, 8, 9), **changes: object) -> TurnRecord:
    fields: dict[str, object] = dict(
        turn=turn,
        user_message=f"question {turn} — ünïcode ✓",
        assistant_text=f"answer {turn}",
        prompt_tokens=10 + turn,
        new_prompt_tokens=4,
        output_token_ids=output,
        finish_reason="stop",
        cached_gpu=3,
        cached_cpu=2,
        cached_recomputed=1,
        started_at=1000.0 + turn,
        finished_at=1000.5 + turn,
    )
    fields.update(changes)
    return TurnRecord(**fields)  # type: ignore[arg-type]


def run_python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


READ_BACK = """
import sys, dataclasses, orjson
from pensieve.store import ConversationStore
with ConversationStore(sys.argv[1]) as store:
    out = {c: {"log": store.token_log(c),
               "turns": [dataclasses.asdict(t) for t in store.turns(c)],
               "meta": dataclasses.asdict(store.meta(c))}
           for c in store.list_conversations()}
print(orjson.dumps(out).decode())
"""


def test_turns_and_log_survive_reopen_in_new_process(tmp_path: Path) -> None:
    logs = {"c-1": [1, 2, 3], "user 42/ü": [5]}
    with ConversationStore(tmp_path / "db") as store:
        for conv_id, log in logs.items():
            store.commit_turn(conv_id, make_turn(0), 0, log)
            store.commit_turn(conv_id, make_turn(1, output=(2**32 - 1,)), len(log), [40, 41])
    seen = orjson.loads(run_python(READ_BACK, str(tmp_path / "db")))
    assert sorted(seen) == sorted(logs)
    for conv_id, log in logs.items():
        assert seen[conv_id]["log"] == log + [40, 41]
        turns = [
            TurnRecord(**{**t, "output_token_ids": tuple(t["output_token_ids"])})
            for t in seen[conv_id]["turns"]
        ]
        assert turns == [make_turn(0), make_turn(1, output=(2**32 - 1,))]
        assert seen[conv_id]["meta"] == {
            "conversation_id": conv_id,
            "created_at": 1000.0,
            "last_active": 1001.5,
            "num_turns": 2,
            "log_len": len(log) + 2,
            "stateless": False,
            "ended": False,
            "tenant": None,
            "opening": [],
        }


def test_commit_is_durable_without_close(tmp_path: Path) -> None:
    # The writing process dies right after committing: nothing is flushed at close.
    write_and_die = """
import os, sys
from pensieve.store import ConversationStore, TurnRecord
store = ConversationStore(sys.argv[1])
record = TurnRecord(0, "u", "a", 3, 3, (9,), "length", 0, 0, 0, 1.0, 2.0)
store.commit_turn("c", record, 0, [1, 2, 3, 9])
os._exit(0)
"""
    run_python(write_and_die, str(tmp_path / "db"))
    with ConversationStore(tmp_path / "db") as store:
        assert store.token_log("c") == [1, 2, 3, 9]
        assert [t.finish_reason for t in store.turns("c")] == ["length"]


def test_keep_len_truncates_before_appending(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "db") as store:
        store.commit_turn("c", make_turn(0), 0, list(range(1, 11)))
        meta = store.commit_turn("c", make_turn(1), 4, [20, 21])
        assert store.token_log("c") == [1, 2, 3, 4, 20, 21]
        assert meta.log_len == 6 and meta.num_turns == 2
        store.commit_turn("c", make_turn(2), 0, [5])
        assert store.token_log("c") == [5]


def test_rejected_commits_change_nothing(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "db") as store:
        store.commit_turn("c", make_turn(0), 0, [1, 2, 3])
        with pytest.raises(ValueError, match="keep_len=4"):
            store.commit_turn("c", make_turn(1), 4, [9])
        with pytest.raises(ValueError, match="has 1 turns; cannot commit turn 3"):
            store.commit_turn("c", make_turn(3), 3, [9])
        with pytest.raises(ValueError, match="token ids"):
            store.commit_turn("c", make_turn(1), 3, [-1])
        assert store.token_log("c") == [1, 2, 3]
        assert [t.turn for t in store.turns("c")] == [0]


def test_unknown_conversation_reads_empty(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "db") as store:
        assert store.token_log("nope") == []
        assert store.turns("nope") == []
        assert store.meta("nope") is None
        assert not store.exists("nope")
        assert store.spills("nope") == {}
        assert store.delete("nope") is False


def test_delete_removes_only_that_conversation(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "db") as store:
        for conv_id in ("a", "b"):
            store.commit_turn(conv_id, make_turn(0), 0, [1])
            store.commit_turn(conv_id, make_turn(1), 1, [2])
        store.put_spills([("a", 0, 10), ("b", 0, 11)])
        assert store.delete("a") is True
        assert store.list_conversations() == ["b"]
        assert (store.token_log("a"), store.turns("a"), store.spills("a")) == ([], [], {})
        assert store.token_log("b") == [1, 2] and len(store.turns("b")) == 2
        assert store.spills("b") == {0: 11}
        store.commit_turn("a", make_turn(0), 0, [3])  # the id is free again, numbering restarts
        assert store.token_log("a") == [3]


def test_map_grows_when_full(tmp_path: Path) -> None:
    big = list(range(70_000))  # 280 KB per turn; the map starts at 32 KiB
    stop = threading.Event()
    reads: list[int] = []

    def reader(store: ConversationStore) -> None:
        while not stop.is_set():
            reads.append(len(store.token_log("big")))

    with ConversationStore(tmp_path / "db", map_size=32 * 1024) as store:
        thread = threading.Thread(target=reader, args=(store,))
        thread.start()
        try:
            for turn in range(5):
                store.commit_turn("big", make_turn(turn), turn * len(big), big)
        finally:
            stop.set()
            thread.join()
        assert store.map_size >= 2 * 2**20
    assert reads and all(n % len(big) == 0 for n in reads)
    with ConversationStore(tmp_path / "db", map_size=32 * 1024) as store:
        assert store.token_log("big") == big * 5


def test_files_are_owner_only(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # even a permissive umask must not widen the modes
    try:
        ConversationStore(tmp_path / "db").close()
    finally:
        os.umask(old_umask)
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE((tmp_path / "db" / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "db").stat().st_mode) == 0o700
    os.chmod(tmp_path / "db" / "data.mdb", 0o644)  # e.g. created by an older version
    ConversationStore(tmp_path / "db").close()
    assert stat.S_IMODE((tmp_path / "db" / "data.mdb").stat().st_mode) == 0o600


def test_spill_index_put_remove_clear(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "db") as store:
        store.put_spills([("a", 0, 5), ("a", 2, 6), ("a", 300, 7), ("b", 1, 8)])
        assert store.spills("a") == {0: 5, 2: 6, 300: 7}
        store.put_spills([("a", 2, 9)])  # moved to another slot
        assert store.remove_spills([("a", 0), ("a", 1), ("b", 1)]) == 2
        assert store.spills("a") == {2: 9, 300: 7}
        assert store.spills("b") == {}
        with pytest.raises(ValueError, match="slot"):
            store.put_spills([("a", 3, 1), ("a", 4, -1)])
        assert store.spills("a") == {2: 9, 300: 7}  # a rejected batch writes nothing
        store.clear_spills()
        assert store.spills("a") == {}
    with ConversationStore(tmp_path / "db") as store:
        assert store.spills("a") == {}


BAD_IDS = ["", "x" * 201, "bad \ud800 surrogate", 42, None]


@pytest.mark.parametrize("bad_id", BAD_IDS)
def test_bad_conversation_ids_are_rejected(tmp_path: Path, bad_id: object) -> None:
    with ConversationStore(tmp_path / "db") as store:
        store.commit_turn("good", make_turn(0), 0, [1, 2])
        store.put_spills([("good", 0, 3)])
        calls = [
            lambda: store.commit_turn(bad_id, make_turn(1), 2, [3]),  # type: ignore[arg-type]
            lambda: store.token_log(bad_id),  # type: ignore[arg-type]
            lambda: store.turns(bad_id),  # type: ignore[arg-type]
            lambda: store.meta(bad_id),  # type: ignore[arg-type]
            lambda: store.delete(bad_id),  # type: ignore[arg-type]
            lambda: store.spills(bad_id),  # type: ignore[arg-type]
            lambda: store.put_spills([("good", 1, 4), (bad_id, 0, 1)]),  # type: ignore[list-item]
            lambda: store.remove_spills([("good", 0), (bad_id, 0)]),  # type: ignore[list-item]
        ]
        for call in calls:
            with pytest.raises(ValueError, match="conversation id"):
                call()
        assert store.list_conversations() == ["good"]
        assert store.token_log("good") == [1, 2]
        assert store.spills("good") == {0: 3}


def test_longest_id_is_accepted(tmp_path: Path) -> None:
    longest = "\U0001f600" * 200  # 800 UTF-8 bytes: more than an LMDB key may hold
    with ConversationStore(tmp_path / "db") as store:
        store.commit_turn(longest, make_turn(0), 0, [1])
        assert store.list_conversations() == [longest]
        assert store.token_log(longest) == [1]


def test_closed_store_refuses_work(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "db")
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.token_log("c")


def test_the_engine_id_is_made_once_and_kept(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "one") as store:
        engine_id = store.engine_id()
        assert re.fullmatch(r"[0-9a-f]{8}", engine_id)
        assert store.list_conversations() == []  # not a conversation
    with ConversationStore(tmp_path / "one") as store:
        assert store.engine_id() == engine_id
    with ConversationStore(tmp_path / "two") as store:
        assert store.engine_id() != engine_id


def test_list_page_walks_every_conversation_once(tmp_path) -> None:
    with ConversationStore(tmp_path) as store:
        for i in range(11):
            store.commit_turn(f"c-{i}", make_turn(0), 0, [1, 2])
        seen, after = [], None
        while True:
            ids, after = store.list_page(after, 4)
            assert len(ids) <= 4
            seen += ids
            if after is None:
                break
        assert sorted(seen) == store.list_conversations() and len(seen) == 11
        assert store.list_page(None, 11)[1] is None  # exactly one page: no cursor to follow


def test_list_page_of_a_tenant_reads_its_own_conversations_only(tmp_path, monkeypatch) -> None:
    """The owner index: a tenant's pages hold its conversations, each once, whatever the
    others have; a page reads the metas of its own entries, not every conversation's."""
    with ConversationStore(tmp_path) as store:
        for i in range(300):
            store.commit_turn(f"b-{i}", make_turn(0), 0, [1], tenant="bob")
        for i in range(5):
            store.commit_turn(f"a-{i}", make_turn(0), 0, [1], tenant="alice")
            store.commit_turn(f"s-{i}", make_turn(0), 0, [1])  # the service's own
        store.commit_turn("a-0", make_turn(1), 1, [2], tenant="bob")  # kept from the first turn
        decoded = []
        decode = codec.decode_meta
        monkeypatch.setattr(codec, "decode_meta", lambda v: decoded.append(1) or decode(v))

        def every_page(tenant: str | None) -> list[str]:
            seen: list[str] = []
            after = None
            while True:
                ids, after = store.list_page(after, 2, tenant)
                seen += ids
                if after is None:
                    return seen

        alices = every_page("alice")
        assert sorted(alices) == [f"a-{i}" for i in range(5)] and len(decoded) == 5
        assert sorted(every_page(None)) == [f"s-{i}" for i in range(5)]
        assert every_page("carol") == []
        store.delete("a-3")
        assert sorted(every_page("alice")) == ["a-0", "a-1", "a-2", "a-4"]
        assert len(every_page("bob")) == 300


def test_a_store_written_before_the_owner_index_gets_it_when_opened(tmp_path) -> None:
    with ConversationStore(tmp_path) as store:
        for i in range(3):
            store.commit_turn(f"a-{i}", make_turn(0), 0, [1], tenant="alice")
        store.commit_turn("b-0", make_turn(0), 0, [1], tenant="bob")
    env = lmdb.open(str(tmp_path), max_dbs=6)  # as an older build left it: no index
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"owners", txn=txn), delete=True)
        txn.delete(b"owners_indexed", db=env.open_db(b"info", txn=txn))
    env.close()
    with ConversationStore(tmp_path) as store:
        assert sorted(store.list_page(None, 10, "alice")[0]) == ["a-0", "a-1", "a-2"]
        assert store.list_page(None, 10, "bob")[0] == ["b-0"]


def test_a_created_conversation_keeps_its_opening_until_its_first_turn(tmp_path: Path) -> None:
    """A conversation made with messages and no turn (`create`) is listed and read back
    from a new process; its first turn keeps its tenant and owner entry, and its record, not
    the meta, then holds the chat before it (`history`)."""
    opening = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    with ConversationStore(tmp_path / "db") as store:
        meta = store.create("c", opening, 500.0, tenant="alice")
        assert (meta.num_turns, meta.log_len, meta.opening) == (0, 0, opening)
        with pytest.raises(ValueError, match="exists"):
            store.create("c", (), 501.0, tenant="bob")
    code = "import sys; from pensieve.store import ConversationStore as S; s = S(sys.argv[1]);"
    code += "m = s.meta('c'); print(m.opening, m.tenant, s.list_page(None, 9, 'alice')[0])"
    printed = run_python(code, str(tmp_path / "db"))
    assert printed.strip() == f"{opening} alice ['c']"
    with ConversationStore(tmp_path / "db") as store:
        history = (*opening, {"role": "assistant", "content": "Hello"})
        meta = store.commit_turn("c", make_turn(0, history=history), 0, [1, 2])
        assert (meta.tenant, meta.created_at, meta.opening, meta.num_turns) == ("alice", 500, (), 1)
        assert store.turns("c")[0].history == history
        assert store.list_page(None, 9, "alice")[0] == ["c"]
        assert store.delete("c") and store.list_page(None, 9, "alice")[0] == []


def test_a_turn_keeps_what_its_reply_was_asked_to_be(tmp_path: Path) -> None:
    """A turn's response format, tools and tool choice are read back as given; a turn that
    asked none of them is stored without them."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    asked = {
        "response_format": {"type": "regex", "regex": "[a-z]+"},
        "tools": (tool,),
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    with ConversationStore(tmp_path / "db") as store:
        store.commit_turn("c", make_turn(0, **asked), 0, [1, 2])
        store.commit_turn("c", make_turn(1), 2, [1, 2, 3, 4])
        first, second = store.turns("c")
    assert {name: getattr(first, name) for name in asked} == asked
    assert (second.response_format, second.tools, second.tool_choice) == (None, (), "none")
    assert b"tool_choice" not in codec.encode_turn(second)
