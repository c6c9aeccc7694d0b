"""ShareGPT loading: the real packaged file, truncated files, JSON Lines and malformed inputs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pensieve.ops import sharegpt
from pensieve.ops.sharegpt import (
    Conversation,
    DatasetError,
    HumanTurn,
    Message,
    Role,
    human_turns,
    load_conversations,
    write_jsonl,
)


def record(conv_id: str, *messages: tuple[str, str]) -> dict[str, object]:
    return {"id": conv_id, "conversations": [{"from": f, "value": v} for f, v in messages]}


RECORDS = [
    record("a", ("human", "hi"), ("gpt", "hello")),
    record("b", ("system", "be brief"), ("user", "q1"), ("assistant", "r1"), ("user", "q2")),
    record("only-bot", ("gpt", "nobody asked")),
    record("c", ("gpt", "welcome"), ("human", "x"), ("human", "y"), ("chatgpt", "z")),
]


def write_json(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    return path


def test_packaged_sharegpt_first_records_load_fast() -> None:
    start = time.perf_counter()
    convs = load_conversations("sharegpt", limit=50)
    assert time.perf_counter() - start < 2.0  # only the head of the 125 MB file is read
    assert len(convs) == 50
    assert len({c.id for c in convs}) == 50
    for conv in convs:
        assert all(isinstance(m.role, Role) and isinstance(m.text, str) for m in conv.turns)
        assert any(m.role is Role.HUMAN for m in conv.turns)
    assert convs[0].id == "QWJhYvA_0"
    first = next(human_turns(convs[0]))
    assert first.text.startswith("Summarize the main ideas of Jeff Walker")
    assert first.reply is not None and first.reply.startswith("Here are the main ideas")


def test_records_are_normalised_and_botonly_ones_skipped(tmp_path: Path) -> None:
    convs = load_conversations(str(write_json(tmp_path / "d.json", RECORDS)))
    assert [c.id for c in convs] == ["a", "b", "c"]
    assert convs[1].turns == (
        Message(Role.SYSTEM, "be brief"),
        Message(Role.HUMAN, "q1"),
        Message(Role.GPT, "r1"),
        Message(Role.HUMAN, "q2"),
    )
    assert list(human_turns(convs[1])) == [HumanTurn(0, "q1", "r1"), HumanTurn(1, "q2", None)]
    assert list(human_turns(convs[2])) == [HumanTurn(0, "x", None), HumanTurn(1, "y", "z")]


def test_limit_counts_kept_conversations(tmp_path: Path) -> None:
    path = write_json(tmp_path / "d.json", RECORDS)
    assert [c.id for c in load_conversations(path, limit=2)] == ["a", "b"]
    assert [c.id for c in load_conversations(path, limit=3)] == ["a", "b", "c"]
    assert load_conversations(path, limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        load_conversations(path, limit=-1)


@pytest.mark.parametrize("cut_back", [1, 7, 20, 60])
def test_truncated_array_keeps_the_complete_records(tmp_path: Path, cut_back: int) -> None:
    text = json.dumps(RECORDS, indent=2)
    last_record_end = text.rindex("}") + 1
    path = tmp_path / "cut.json"
    path.write_text(text[: last_record_end - cut_back], encoding="utf-8")
    assert [c.id for c in load_conversations(path)] == ["a", "b"]


def test_truncation_across_read_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny reads put a chunk boundary inside every token, escape and multi-byte character.
    monkeypatch.setattr(sharegpt, "READ_CHUNK_CHARS", 3)
    records = [record(f"r{i}", ("human", f'é\\u{i} "q"\n✓'), ("gpt", "ok")) for i in range(30)]
    text = json.dumps(records)
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 30], encoding="utf-8")
    convs = load_conversations(path)
    assert [c.id for c in convs] == [f"r{i}" for i in range(29)]
    assert convs[3].turns[0].text == 'é\\u3 "q"\n✓'


def test_jsonl_roundtrip_and_cut_last_line(tmp_path: Path) -> None:
    convs = load_conversations(write_json(tmp_path / "d.json", RECORDS))
    write_jsonl(convs, tmp_path / "d.jsonl")
    assert load_conversations(tmp_path / "d.jsonl") == convs
    text = (tmp_path / "d.jsonl").read_text()
    (tmp_path / "cut.jsonl").write_text(text[:-10])
    assert load_conversations(tmp_path / "cut.jsonl") == convs[:-1]


def test_repeated_ids_are_made_unique(tmp_path: Path) -> None:
    same = record("dup", ("human", "q"))
    convs = load_conversations(write_json(tmp_path / "d.json", [same, same, same]))
    assert [c.id for c in convs] == ["dup", "dup~1", "dup~2"]


MALFORMED = {
    "missing conversations": ([{"id": "x"}], "record 0: 'conversations' must be a list"),
    "record not an object": ([record("a", ("human", "q")), 5], "record 1: expected an object"),
    "message not an object": ([{"id": "x", "conversations": ["hi"]}], "message 0: expected"),
    "value not a string": (
        [record("a", ("human", "q")) | {"conversations": [{"from": "human", "value": None}]}],
        "record 0, message 0: 'value' must be a string",
    ),
    "unknown role": ([record("a", ("robot", "q"))], "unknown role 'robot'"),
    "bad id": ([{"id": ["x"], "conversations": []}], "'id' must be a non-empty string"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_records_raise_dataset_error(tmp_path: Path, case: str) -> None:
    records, message = MALFORMED[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(records))
    with pytest.raises(DatasetError, match=message) as info:
        load_conversations(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("hello world", "not a JSON array or JSON Lines"),
        ('[{"id": "a", "conversations": [}, {"id": "b"}]', r"record 0: invalid JSON"),
        ('[{"id": "a", "conversations": []} {"id": "b"}]', "expected ',' or ']'"),
        ('{"id": "a", "conversations": []}\n{oops}\n{"id": "c"}\n', "line 2: invalid JSON"),
        ("[]", "no conversation with a human message"),
    ],
)
def test_unreadable_files_raise_dataset_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_conversations(path)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_conversations(tmp_path / "absent.json")
    (tmp_path / "bin.json").write_bytes(b"[\xff\xfe\x00")
    with pytest.raises(DatasetError, match="not UTF-8"):
        load_conversations(tmp_path / "bin.json")


def test_conversation_is_frozen() -> None:
    conv = Conversation("a", (Message(Role.HUMAN, "q"),))
    with pytest.raises(AttributeError):
        conv.id = "b"  # type: ignore[misc]
