"""The messages the actors send each other on `pensieve.internal.*` (and the KV event plane).

One frozen msgspec Struct per message, grouped by the actor that receives it. Every message is a
JSON object whose first field is `"v"`, the schema version of its kind: a receiver refuses a
version it does not know (or none) with `MessageError` instead of misreading it. Types and ranges
are checked while decoding; a message's `check` adds the rules that span fields. No tensor ever
crosses: token ids, block ids and slots are plain integers.
"""

from __future__ import annotations

import enum
import functools
from typing import Annotated, Any, TypeVar

import msgspec

VERSION = 1

# {"role": "system" | "user" | "assistant" | "tool", "content": str}, and an assistant's
# "tool_calls" (OpenAI's shape, arguments as JSON text) or a tool result's "tool_call_id"
ChatMessage = dict[str, Any]
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]

_M = TypeVar("_M", bound="Message")


class MessageError(ValueError):
    """A message that does not decode as its schema (wrong version, missing field, bad type)."""


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="v", tag=VERSION):
    """A message that crosses NATS on its own: encoded with `"v": VERSION` first."""

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    def check(self) -> None:
        """Raise MessageError unless the fields make sense together (called on every decoded
        message; types and ranges are the decoder's)."""


class _OtherVersion(Message, frozen=True, tag=0):
    # msgspec requires the tag field only of a union's members: decoded as `cls | _OtherVersion`,
    # a message without "v" is refused rather than read as this version
    pass


_ENCODER = msgspec.json.Encoder()
# what decoding bytes that are no JSON raises: msgspec checks UTF-8 only as it reads a string,
# and nests as deep as Python's recursion limit
UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


@functools.cache
def _decoder(cls: type[Message]) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(cls | _OtherVersion)


class _Version(msgspec.Struct):
    v: Any = None


def encode(message: Message) -> bytes:
    """A message as bytes."""
    return message.encode()


def decode(data: bytes, cls: type[_M]) -> _M:
    """A message of class `cls`, its version and fields checked."""
    kind = cls.__name__
    try:
        message = _decoder(cls).decode(data)
    except msgspec.ValidationError as error:
        raise _refusal(data, kind, str(error)) from None
    except UNREADABLE as error:
        raise MessageError(f"{kind}: not JSON ({error})") from None
    if not isinstance(message, cls):
        raise _refusal(data, kind, "")
    message.check()
    return message


def _refusal(data: bytes, kind: str, problem: str) -> MessageError:
    """Why a message of `kind` was refused: its version, when that is not this build's."""
    try:
        version = msgspec.json.decode(data, type=_Version).v
    except UNREADABLE:  # not an object: the decoder's own words say so
        return MessageError(f"{kind}: {problem}")
    if version != VERSION:
        return MessageError(f"{kind}: schema version {version!r}, this build reads {VERSION}")
    return MessageError(f"{kind}: {problem}")


# ---- tokenizer ------------------------------------------------------------------------------


class RenderRequest(Message, frozen=True, omit_defaults=True):
    """To the tokenizer (`render`): the chat template over a whole conversation, ending with the
    assistant's turn opening; or, with `prompt` (and no messages), a raw completion's text
    encoded as it is."""

    messages: tuple[dict[str, Any], ...]  # each {"role": str, "content": str} (`ChatMessage`)
    # the longest prompt the engine takes: a longer one is refused `too_long` by the replica,
    # rather than sent back (its ids may not fit in one NATS message)
    max_tokens: Positive | None = None
    prompt: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # function definitions, for the template to show
    prefill: str = ""  # text that starts the assistant's reply (a forced tool call's opening)

    def check(self) -> None:
        if not all(
            {"role", "content"} <= message.keys() <= MESSAGE_KEYS for message in self.messages
        ):
            raise MessageError("RenderRequest: messages must be a list of {role, content} strings")
        if self.prompt is not None and (self.messages or self.tools or self.prefill):
            raise MessageError("RenderRequest: prompt must be a string, given without messages")


class RenderReply(Message, frozen=True):
    """From the tokenizer: the prompt's token ids."""

    token_ids: list[int]


class TextPiece(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One reply's new tokens to turn into text, a part of a `DetokenizeRequest`.

    A replica keeps nothing between requests, so the piece says where the last answer left off:
    `ids` are the reply's output token ids from index `start` on; those before `read` have given
    their text already, and those from `prefix` on are decoded again as context (a character or
    a leading space may depend on the token before). `tail` is the end of the text found so far,
    where a stop string may have begun. A `final` piece holds the whole reply (`start` 0): its
    answer also carries the reply's whole text."""

    key: str  # the turn's request id
    ids: tuple[int, ...]
    start: NonNegative
    prefix: NonNegative
    read: NonNegative
    tail: str = ""
    stop: tuple[NonEmpty, ...] = ()
    final: bool = False
    trace: str = ""  # a final piece's W3C traceparent: the turn it ends (empty: not traced)

    def check(self) -> None:
        """Raise MessageError unless the offsets make sense (a received piece; one made here is
        trusted, as it is made once per turn and step)."""
        end = self.start + len(self.ids)
        if not self.start <= self.prefix <= self.read <= end or (self.final and self.start):
            raise MessageError(
                "TextPiece: needs start <= prefix <= read <= the last id, and a "
                "final piece from the reply's first token"
            )


class TextUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The answer to one `TextPiece`: drop the last `trim` characters of the text found so far
    (the start of a stop string, never streamed) and append `text`; the next piece starts from
    `prefix` and `read`. `stop_at`: a stop string completes with the reply's token number
    `stop_at` (counted from 1), so the reply is its first `stop_at` tokens. `whole` (a final
    piece only): the reply's text, decoded whole and cut before its first stop string."""

    key: str
    text: str
    trim: NonNegative
    prefix: NonNegative
    read: NonNegative
    stop_at: Positive | None = None
    whole: str | None = None


class DetokenizeRequest(Message, frozen=True):
    """To the tokenizer (`detokenize`): one step's new reply tokens, of every turn that streams
    or has stop strings, and the last tokens of every turn that ended."""

    pieces: tuple[TextPiece, ...]

    def check(self) -> None:
        for piece in self.pieces:
            piece.check()

    @staticmethod
    def decode(data: bytes) -> DetokenizeRequest:
        return decode(data, DetokenizeRequest)


class DetokenizeReply(Message, frozen=True):
    """From the tokenizer: one update per piece, in the request's order."""

    updates: tuple[TextUpdate, ...]

    @staticmethod
    def decode(data: bytes) -> DetokenizeReply:
        return decode(data, DetokenizeReply)


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
    SEALED = "sealed"  # full and computed: found by its content `key` from now on
    UNSEALED = "unsealed"  # its key is withdrawn: its tail is written again (the history was cut)


class KvEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chunk's change, and where the chunk is right after it: `gpu_block` and `cpu_slot`
    (None: not in that tier). A chunk with both counts as on the GPU: a swapped-out chunk keeps
    its block until the block is reused (lazy reclaim). A REMOVED event has neither.

    `key`: the chunk's content key right after the change (`chunk_keys.py`), None while it is
    unsealed (partial, or not yet known); `parent`: with a key, the key it is chained to, that
    of chunk index - 1, or for chunk 0 the seed of its namespace (model, tenant, cache salt),
    so that key = chunk_key(parent, its tokens) for every chunk."""

    kind: KvEventKind
    conversation_id: str
    index: NonNegative  # chunk i holds positions [i * block_size, (i + 1) * block_size)
    gpu_block: NonNegative | None = None
    cpu_slot: NonNegative | None = None
    key: bytes | None = None  # (in JSON: base64)
    parent: bytes | None = None


class KvEventBatch(Message, frozen=True):
    """On `pensieve.v1.engine.<id>.kv`: one engine step's chunk events, in the order they
    happened. `seq` numbers an engine process's batches 1, 2, 3, ... (a gap means batches were
    lost); `time` is when the step ended, in Unix seconds."""

    engine_id: str
    seq: Positive
    time: float
    events: tuple[KvEvent, ...]


def encode_kv_events(batch: KvEventBatch) -> bytes:
    return batch.encode()


def decode_kv_events(data: bytes) -> KvEventBatch:
    return decode(data, KvEventBatch)


class LoadReport(Message, frozen=True):
    """On `pensieve.v1.engine.<id>.load`, soon after its turns change and every
    `LOAD_REPORT_EVERY_S` while the engine serves: what it has in hand, for the ingress to
    place new turns by (`actors/ingress/placement.py`). `num_active_tokens`: the context of its
    running and waiting turns; `num_free_blocks`: GPU blocks free or reclaimable at once, of
    `num_blocks`. `time`: when it was sent, in Unix seconds."""

    engine_id: str
    time: float
    block_size: Positive
    num_running: NonNegative
    num_waiting: NonNegative
    num_active_tokens: NonNegative
    num_free_blocks: NonNegative
    num_blocks: NonNegative


LOAD_REPORT_EVERY_S = 0.5


# ---- recompute planner ----------------------------------------------------------------------


class RecomputePlanRequest(Message, frozen=True):
    """To the recompute planner (`plan`): which of the conversation's first `num_positions`
    positions must be recomputed (None: its whole stored token log)."""

    conversation_id: str
    num_positions: NonNegative | None = None


class RecomputePlan(Message, frozen=True):
    """From the recompute planner: where the KV of positions [0, num_positions) is. `ranges`
    ([start, end), in order, adjacent ones merged) are in no tier and must be recomputed from
    the raw tokens; the counts add up to num_positions. `known` False: the planner cannot tell
    (its view of the tiers is stale), and the ranges and counts are empty."""

    conversation_id: str
    known: bool
    log_len: NonNegative  # tokens in the stored log it read
    num_positions: NonNegative
    ranges: tuple[tuple[NonNegative, int], ...]
    recomputed_tokens: NonNegative
    gpu_tokens: NonNegative
    cpu_tokens: NonNegative

    def check(self) -> None:
        if not all(start < end for start, end in self.ranges):
            raise MessageError("RecomputePlan: ranges must be [start, end] pairs, 0 <= start < end")


class Tier(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    DROPPED = "dropped"


def tier_of(gpu_block: int | None, cpu_slot: int | None) -> Tier:
    """Where a chunk is: on the GPU if it has a block (a CPU slot as well: swapped out, its block
    not yet reused), on the CPU if it has only a slot, dropped if it has neither."""
    if gpu_block is not None:
        return Tier.GPU
    return Tier.CPU if cpu_slot is not None else Tier.DROPPED
