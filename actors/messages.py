"""The messages the actors send each other on `pensieve.internal.*` (and the KV event plane).

One frozen dataclass per message, grouped by the actor that receives it. Every message is an
orjson object with `"v"`, the schema version of its kind: a receiver refuses a version it does not
know with `MessageError` instead of misreading it. No tensor ever crosses: token ids, block ids
and slots are plain integers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import orjson

VERSION = 1

_M = TypeVar("_M")


class MessageError(ValueError):
    """A message that does not decode as its schema (wrong version, missing field, bad type)."""


def encode(message: object) -> bytes:
    """A message dataclass as bytes (tuples become lists, nested dataclasses objects)."""
    return orjson.dumps({"v": VERSION, **dataclasses.asdict(message)})  # type: ignore[call-overload]


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


# ---- executor -------------------------------------------------------------------------------


# ---- KV event plane -------------------------------------------------------------------------
