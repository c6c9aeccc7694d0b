"""The messages the actors send each other on `pensieve.internal.*` (and the KV event plane).

One frozen dataclass per message, grouped by the actor that receives it. Every message is an
orjson object with `"v"`, the schema version of its kind: a receiver refuses a version it does not
know with `MessageError` instead of misreading it. No tensor ever crosses: token ids, block ids
and slots are plain integers.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Protocol, TypeVar

import orjson

VERSION = 1

_M = TypeVar("_M")


class MessageError(ValueError):
    """A message that does not decode as its schema (wrong version, missing field, bad type)."""


def encode(message: object) -> bytes:
    """A message dataclass as bytes (tuples become lists, nested dataclasses objects)."""
    # orjson writes nested dataclasses itself; asdict would deep-copy every list first
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}  # type: ignore[arg-type]
    return orjson.dumps({"v": VERSION, **fields})


def decode_fields(data: bytes, kind: str) -> dict[str, Any]:
    """The fields of a message of `kind`, version checked; the caller builds the dataclass."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise MessageError(f"{kind}: not JSON ({error})") from None
    if not isinstance(body, dict):
        raise MessageError(f"{kind}: not a JSON object")
    version = body.pop("v", None)
    if version != VERSION:
        raise MessageError(f"{kind}: schema version {version!r}, this build reads {VERSION}")
    return body


def decode(data: bytes, cls: type[_M]) -> _M:
    """A flat message (fields of JSON types only) of class `cls`."""
    body = decode_fields(data, cls.__name__)
    try:
        return cls(**body)
    except TypeError as error:
        raise MessageError(f"{cls.__name__}: {error}") from None


# ---- tokenizer ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RenderRequest:
    """To the tokenizer (`render`): the chat template over a whole conversation, ending with the
    assistant's turn opening; or, with `prompt` (and no messages), a raw completion's text
    encoded as it is."""

    messages: tuple[dict[str, str], ...]  # each exactly {"role": str, "content": str}
    # the longest prompt the engine takes: a longer one is refused `too_long` by the replica,
    # rather than sent back (its ids may not fit in one NATS message)
    max_tokens: int | None = None
    prompt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list | tuple) or not all(
            _is_chat_message(m) for m in self.messages
        ):
            raise MessageError("RenderRequest: messages must be a list of {role, content} strings")
        if not (self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1)):
            raise MessageError("RenderRequest: max_tokens must be null or >= 1")
        if self.prompt is not None and (not isinstance(self.prompt, str) or self.messages):
            raise MessageError("RenderRequest: prompt must be a string, given without messages")
        object.__setattr__(self, "messages", tuple(self.messages))  # decoded, it is a list

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": VERSION, "messages": self.messages}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.prompt is not None:
            body["prompt"] = self.prompt
        return orjson.dumps(body)


@dataclasses.dataclass(frozen=True)
class RenderReply:
    """From the tokenizer: the prompt's token ids."""

    token_ids: list[int]

    def __post_init__(self) -> None:
        ids = self.token_ids
        if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
            raise MessageError("RenderReply: token_ids must be a list of integers")

    def encode(self) -> bytes:
        # written out by hand: the ids go to orjson as they are, with no per-field detour
        return orjson.dumps({"v": VERSION, "token_ids": self.token_ids})


@dataclasses.dataclass(frozen=True, slots=True)
class TextPiece:
    """One reply's new tokens to turn into text, a part of a `DetokenizeRequest`.

    A replica keeps nothing between requests, so the piece says where the last answer left off:
    `ids` are the reply's output token ids from index `start` on; those before `read` have given
    their text already, and those from `prefix` on are decoded again as context (a character or
    a leading space may depend on the token before). `tail` is the end of the text found so far,
    where a stop string may have begun. A `final` piece holds the whole reply (`start` 0): its
    answer also carries the reply's whole text."""

    key: str  # the turn's request id
    ids: tuple[int, ...]
    start: int
    prefix: int
    read: int
    tail: str = ""
    stop: tuple[str, ...] = ()
    final: bool = False
    trace: str = ""  # a final piece's W3C traceparent: the turn it ends (empty: not traced)

    def check(self) -> None:
        """Raise MessageError unless the fields make sense (a received piece; one made here is
        trusted, as it is made once per turn and step)."""
        offsets = (self.start, self.prefix, self.read)
        if not (isinstance(self.key, str) and all(_is_int(n) and n >= 0 for n in offsets)):
            raise MessageError("TextPiece: key must be a string and the offsets integers >= 0")
        if not isinstance(self.ids, list | tuple) or not set(map(type, self.ids)) <= {int}:
            raise MessageError("TextPiece: ids must be a list of integers")
        end = self.start + len(self.ids)
        if not self.start <= self.prefix <= self.read <= end or (self.final and self.start):
            raise MessageError(
                "TextPiece: needs start <= prefix <= read <= the last id, and a "
                "final piece from the reply's first token"
            )
        if not isinstance(self.stop, list | tuple) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise MessageError("TextPiece: stop must be a list of non-empty strings")
        if not (isinstance(self.tail, str) and isinstance(self.trace, str)):
            raise MessageError("TextPiece: tail and trace must be strings")
        if not isinstance(self.final, bool):
            raise MessageError("TextPiece: final must be a boolean")
        object.__setattr__(self, "ids", tuple(self.ids))  # decoded, these are lists
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclasses.dataclass(frozen=True, slots=True)
class TextUpdate:
    """The answer to one `TextPiece`: drop the last `trim` characters of the text found so far
    (the start of a stop string, never streamed) and append `text`; the next piece starts from
    `prefix` and `read`. `stop_at`: a stop string completes with the reply's token number
    `stop_at` (counted from 1), so the reply is its first `stop_at` tokens. `whole` (a final
    piece only): the reply's text, decoded whole and cut before its first stop string."""

    key: str
    text: str
    trim: int
    prefix: int
    read: int
    stop_at: int | None = None
    whole: str | None = None

    def check(self) -> None:
        """Raise MessageError unless the fields make sense (as `TextPiece.check`)."""
        counts = (self.trim, self.prefix, self.read)
        if not (isinstance(self.key, str) and isinstance(self.text, str)):
            raise MessageError("TextUpdate: key and text must be strings")
        if not all(_is_int(n) and n >= 0 for n in counts):
            raise MessageError("TextUpdate: trim, prefix and read must be integers >= 0")
        if not (self.stop_at is None or (_is_int(self.stop_at) and self.stop_at >= 1)):
            raise MessageError("TextUpdate: stop_at must be null or an integer >= 1")
        if not (self.whole is None or isinstance(self.whole, str)):
            raise MessageError("TextUpdate: whole must be null or a string")


@dataclasses.dataclass(frozen=True)
class DetokenizeRequest:
    """To the tokenizer (`detokenize`): one step's new reply tokens, of every turn that streams
    or has stop strings, and the last tokens of every turn that ended."""

    pieces: tuple[TextPiece, ...]

    def encode(self) -> bytes:
        return orjson.dumps({"v": VERSION, "pieces": self.pieces})

    @staticmethod
    def decode(data: bytes) -> DetokenizeRequest:
        return DetokenizeRequest(_items(data, "DetokenizeRequest", "pieces", TextPiece))


@dataclasses.dataclass(frozen=True)
class DetokenizeReply:
    """From the tokenizer: one update per piece, in the request's order."""

    updates: tuple[TextUpdate, ...]

    def encode(self) -> bytes:
        return orjson.dumps({"v": VERSION, "updates": self.updates})

    @staticmethod
    def decode(data: bytes) -> DetokenizeReply:
        return DetokenizeReply(_items(data, "DetokenizeReply", "updates", TextUpdate))


class _Checked(Protocol):
    def check(self) -> None: ...


_C = TypeVar("_C", bound=_Checked)


def _items(data: bytes, kind: str, name: str, cls: type[_C]) -> tuple[_C, ...]:
    """The list field `name` of a message of `kind`, each item built as `cls` and checked."""
    body = decode_fields(data, kind)
    items = body.pop(name, None)
    if body or not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise MessageError(f"{kind}: must hold exactly {name}, a list of objects")
    try:
        built = tuple(cls(**item) for item in items)
    except TypeError as error:
        raise MessageError(f"{kind}: {error}") from None
    for item in built:
        item.check()
    return built


def _is_chat_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and message.keys() == {"role", "content"}
        and all(isinstance(value, str) for value in message.values())
    )


# ---- executor -------------------------------------------------------------------------------


# ---- KV event plane -------------------------------------------------------------------------


class KvEventKind(enum.Enum):
    """What happened to a chunk of a conversation's KV."""

    STORED = "stored"  # a new chunk got a GPU block: its KV is being computed
    RECOMPUTED = "recomputed"  # a dropped chunk got a GPU block: its KV is computed again
    SWAPPED_IN = "swapped_in"  # copied from its CPU slot into a GPU block
    SWAPPED_OUT = "swapped_out"  # has a CPU copy; a GPU block it still holds is reused at will
    RECLAIMED = "reclaimed"  # its GPU block went to another chunk; its CPU copy is left
    CPU_FREED = "cpu_freed"  # its CPU copy was given up (stale, or the slot was needed)
    DROPPED = "dropped"  # no copy anywhere: its positions are recomputed when next needed
    REMOVED = "removed"  # the conversation's chunks from `index` on are forgotten (0: all)


@dataclasses.dataclass(frozen=True, slots=True)
class KvEvent:
    """One chunk's change, and where the chunk is right after it: `gpu_block` and `cpu_slot`
    (None: not in that tier). A chunk with both counts as on the GPU: a swapped-out chunk keeps
    its block until the block is reused (lazy reclaim). A REMOVED event has neither."""

    kind: KvEventKind
    conversation_id: str
    index: int  # chunk i holds positions [i * block_size, (i + 1) * block_size)
    gpu_block: int | None = None
    cpu_slot: int | None = None


@dataclasses.dataclass(frozen=True)
class KvEventBatch:
    """On `pensieve.v1.engine.<id>.kv`: one engine step's chunk events, in the order they
    happened. `seq` numbers an engine process's batches 1, 2, 3, ... (a gap means batches were
    lost); `time` is when the step ended, in Unix seconds."""

    engine_id: str
    seq: int
    time: float
    events: tuple[KvEvent, ...]


def encode_kv_events(batch: KvEventBatch) -> bytes:
    # orjson writes the events (dataclasses with an enum) itself: no Python per event on the
    # engine thread, which encodes every batch
    fields = {"engine_id": batch.engine_id, "seq": batch.seq, "time": batch.time}
    return orjson.dumps({"v": VERSION, **fields, "events": batch.events})


def decode_kv_events(data: bytes) -> KvEventBatch:
    body = decode_fields(data, "KvEventBatch")
    try:
        events = tuple(_kv_event(fields) for fields in body.pop("events"))
        batch = KvEventBatch(events=events, **body)
    except (KeyError, TypeError, ValueError) as error:
        raise MessageError(f"KvEventBatch: {error}") from None
    if not (_is_int(batch.seq) and batch.seq >= 1 and isinstance(batch.engine_id, str)):
        raise MessageError("KvEventBatch: engine_id must be a string and seq an integer >= 1")
    if not isinstance(batch.time, int | float):
        raise MessageError("KvEventBatch: time must be a number")
    return batch


def _kv_event(fields: Any) -> KvEvent:
    if not isinstance(fields, dict):
        raise ValueError("an event must be an object")
    event = KvEvent(KvEventKind(fields.pop("kind", None)), **fields)
    blocks = (event.gpu_block, event.cpu_slot)
    if not (isinstance(event.conversation_id, str) and _is_int(event.index) and event.index >= 0):
        raise ValueError("an event needs a conversation_id string and an index >= 0")
    if not all(block is None or (_is_int(block) and block >= 0) for block in blocks):
        raise ValueError("gpu_block and cpu_slot must be null or integers >= 0")
    return event


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- recompute planner ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecomputePlanRequest:
    """To the recompute planner (`plan`): which of the conversation's first `num_positions`
    positions must be recomputed (None: its whole stored token log)."""

    conversation_id: str
    num_positions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.conversation_id, str):
            raise MessageError("RecomputePlanRequest: conversation_id must be a string")
        count = self.num_positions
        if not (count is None or (_is_int(count) and count >= 0)):
            raise MessageError("RecomputePlanRequest: num_positions must be null or >= 0")


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """From the recompute planner: where the KV of positions [0, num_positions) is. `ranges`
    ([start, end), in order, adjacent ones merged) are in no tier and must be recomputed from
    the raw tokens; the counts add up to num_positions. `known` False: the planner cannot tell
    (its view of the tiers is stale), and the ranges and counts are empty."""

    conversation_id: str
    known: bool
    log_len: int  # tokens in the stored log it read
    num_positions: int
    ranges: tuple[tuple[int, int], ...]
    recomputed_tokens: int
    gpu_tokens: int
    cpu_tokens: int

    def __post_init__(self) -> None:
        counts = (
            self.log_len,
            self.num_positions,
            self.recomputed_tokens,
            self.gpu_tokens,
            self.cpu_tokens,
        )
        if not all(_is_int(count) and count >= 0 for count in counts):
            raise MessageError("RecomputePlan: the lengths and counts must be integers >= 0")
        if not (isinstance(self.conversation_id, str) and isinstance(self.known, bool)):
            raise MessageError("RecomputePlan: conversation_id must be a string, known a bool")
        if not isinstance(self.ranges, list | tuple) or not all(map(_is_range, self.ranges)):
            raise MessageError("RecomputePlan: ranges must be [start, end] pairs, 0 <= start < end")
        object.__setattr__(self, "ranges", tuple(tuple(r) for r in self.ranges))  # decoded: lists


def _is_range(pair: object) -> bool:
    return (
        isinstance(pair, list | tuple)
        and len(pair) == 2
        and all(map(_is_int, pair))
        and 0 <= pair[0] < pair[1]
    )
