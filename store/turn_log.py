"""What a conversation's replicated log holds, and how a store is rebuilt from it.

The log (on JetStream, see `actors/wire/jetstream.py`) has one entry per write the store takes
for the conversation, in order: its creation with opening messages (`Created`), each committed
turn as the token log's change and the turn's record (`Committed`), and a mark each time an
engine adopts it (`Adopted`, which the store ignores). Replaying the entries through
`ConversationStore` gives the store the engine that wrote them had.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pensieve.store import codec
from pensieve.store.conversation_store import ConversationStore
from pensieve.store.records import Messages, TurnRecord


class Created(msgspec.Struct, tag="created", frozen=True):
    opening: list[dict[str, object]]
    created_at: float
    tenant: str | None


class Committed(msgspec.Struct, tag="committed", frozen=True):
    record: bytes  # `codec.encode_turn`
    keep_len: int  # the token log keeps this many tokens, then `appended`
    appended: list[int]
    stateless: bool
    final: bool
    tenant: str | None


class Adopted(msgspec.Struct, tag="adopted", frozen=True):
    engine: str


Entry = Created | Committed | Adopted
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Entry)


def committed(
    record: TurnRecord,
    keep_len: int,
    appended: Sequence[int],
    stateless: bool,
    final: bool,
    tenant: str | None,
) -> bytes:
    entry = Committed(codec.encode_turn(record), keep_len, list(appended), stateless, final, tenant)
    return _encoder.encode(entry)


def created(opening: Messages, created_at: float, tenant: str | None) -> bytes:
    return _encoder.encode(Created([dict(m) for m in opening], created_at, tenant))


def adopted(engine: str) -> bytes:
    return _encoder.encode(Adopted(engine))


def decode(data: bytes) -> Entry:
    return _decoder.decode(data)


def tenant_of(entries: Sequence[Entry]) -> str | None:
    """The tenant of a conversation whose log is `entries` (its first store write names it)."""
    for entry in entries:
        if isinstance(entry, Created | Committed):
            return entry.tenant
    return None


def num_turns(entries: Sequence[Entry]) -> int:
    return sum(isinstance(entry, Committed) for entry in entries)


def in_step(store: ConversationStore, conv_id: str, entries: Sequence[Entry]) -> bool:
    """Whether the store holds exactly the conversation that `entries` make."""
    meta = store.meta(conv_id)
    if meta is None:
        return not any(isinstance(entry, Created | Committed) for entry in entries)
    return meta.num_turns == num_turns(entries) and store.token_log(conv_id) == _log(entries)


def rebuild(store: ConversationStore, conv_id: str, entries: Sequence[Entry]) -> None:
    """Make the store's copy of the conversation the one that `entries` make (each write
    durable; call it from the store writer's thread)."""
    store.delete(conv_id)
    for entry in entries:
        if isinstance(entry, Created):
            opening = tuple(dict(m) for m in entry.opening)
            store.create(conv_id, opening, entry.created_at, entry.tenant)
        elif isinstance(entry, Committed):
            record = codec.decode_turn(entry.record)
            store.commit_turn(
                conv_id,
                record,
                entry.keep_len,
                entry.appended,
                entry.stateless,
                entry.final,
                entry.tenant,
            )


def _log(entries: Sequence[Entry]) -> list[int]:
    log: list[int] = []
    for entry in entries:
        if isinstance(entry, Committed):
            log = log[: entry.keep_len] + entry.appended
    return log
