"""Byte layout of the store: keys, the packed token log, and orjson-encoded records.

Conversation ids are arbitrary user strings of up to 200 characters (up to 800 UTF-8 bytes), which
can exceed LMDB's 511-byte key limit, so every key starts with a fixed 16-byte BLAKE2b digest of
the id. The id itself is kept in the conversation's meta value.

    sub-database  key                                   value
    meta          digest(id)                            orjson {id, created_at, last_active, ...}
    logs          digest(id)                            uint32 little-endian token ids
    turns         digest(id) + turn index (u32 BE)      orjson TurnRecord
    spills        digest(id) + chunk index (u32 BE)     orjson CPU slot number
    owners        owner prefix + digest(id)             empty: the conversations of one tenant

Big-endian indices keep one conversation's turns and chunks in order under a cursor. An owner
prefix is "t" + the tenant's name + NUL, or NUL alone for the service's own conversations (a
tenant's name holds no NUL), so one tenant's conversations lie together, in digest order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import orjson

from pensieve.store.records import ConversationMeta, TurnRecord

DIGEST_BYTES = 16
_INDEX = struct.Struct(">I")
MAX_U32 = 2**32 - 1


def conversation_key(conv_id: str) -> bytes:
    return hashlib.blake2b(conv_id.encode("utf-8"), digest_size=DIGEST_BYTES).digest()


def owner_prefix(tenant: str | None) -> bytes:
    """The start of the `owners` keys of `tenant`'s conversations (None: the service's own)."""
    return b"\0" if tenant is None else b"t" + tenant.encode("utf-8") + b"\0"


def indexed_key(conv_key: bytes, index: int) -> bytes:
    """Key of turn or chunk `index` of a conversation (0 <= index < 2**32)."""
    if not 0 <= index <= MAX_U32:
        raise ValueError(f"index {index} is out of range")
    return conv_key + _INDEX.pack(index)


def index_of(key: bytes) -> int:
    return int(_INDEX.unpack_from(key, DIGEST_BYTES)[0])


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes; ValueError on ids outside [0, 2**32)."""
    try:
        packed = array("I", tokens)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    return _little_endian(packed).tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    tokens = array("I")
    tokens.frombytes(data)
    return _little_endian(tokens).tolist()


def _little_endian(tokens: array[int]) -> array[int]:
    assert tokens.itemsize == 4, "array('I') must be 32-bit on this platform"
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


# a turn record's fields left out when they hold this (their default)
_UNUSED_TURN_FIELDS: dict[str, Any] = {
    "history": None,
    "response_format": None,
    "tools": (),
    "tool_choice": "none",
}


def encode_turn(record: TurnRecord) -> bytes:
    fields = dataclasses.asdict(record)
    for name, unused in _UNUSED_TURN_FIELDS.items():
        if fields[name] == unused:  # the common case, written as before the field existed
            del fields[name]
    return orjson.dumps(fields)


def decode_turn(data: bytes) -> TurnRecord:
    fields: dict[str, Any] = orjson.loads(data)
    fields["output_token_ids"] = tuple(fields["output_token_ids"])
    if fields.get("history") is not None:
        fields["history"] = tuple(fields["history"])
    return TurnRecord(**fields)


def encode_meta(meta: ConversationMeta) -> bytes:
    fields = dataclasses.asdict(meta)
    if not meta.opening:  # every meta after its first turn: kept small for the sweeps
        del fields["opening"]
    return orjson.dumps(fields)


def decode_meta(data: bytes) -> ConversationMeta:
    fields: dict[str, Any] = orjson.loads(data)
    fields["opening"] = tuple(fields.get("opening", ()))
    return ConversationMeta(**fields)


def encode_slot(slot: int) -> bytes:
    return orjson.dumps(slot)


def decode_slot(data: bytes) -> int:
    slot = orjson.loads(data)
    assert isinstance(slot, int)
    return slot
