"""The LMDB store: each conversation's token log and turn records, and the CPU-tier spill index.

One `ConversationStore` per process, opened once. Every method is one LMDB transaction and may be
called from any thread; writes are durable when the method returns (LMDB syncs at commit). The
engine's step loop does not call the write methods directly: it submits them to a `StoreWriter`.
Key layout: see `pensieve.store.codec`.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import lmdb

from pensieve.store import codec
from pensieve.store.records import (
    ConversationMeta,
    Messages,
    TurnRecord,
    validate_conversation_id,
)
from pensieve.store.resize_gate import ResizeGate

logger = logging.getLogger(__name__)

DEFAULT_MAP_SIZE = 64 * 2**20
FILE_MODE = 0o600
DIR_MODE = 0o700
_T = TypeVar("_T")


class ConversationStore:
    """Token logs, turn records, conversation metadata and the spill index, in one LMDB env.

    Invariants kept by `commit_turn`: turns are numbered 0, 1, 2, ... with no gaps, and
    `meta(c).log_len == len(token_log(c))`. Reads of an unknown conversation return empty results
    (`meta` returns None). Every method rejects a bad conversation id with ValueError before it
    touches the database.
    """

    def __init__(self, path: Path | str, map_size: int = DEFAULT_MAP_SIZE) -> None:
        self._path = Path(path)
        self._path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self._env = lmdb.open(
            str(self._path), map_size=map_size, max_dbs=6, mode=FILE_MODE, readahead=False
        )
        _restrict_file_modes(self._path)
        self._gate = ResizeGate()
        self._closed = False
        self._meta = self._open_db(b"meta")
        self._logs = self._open_db(b"logs")
        self._turns = self._open_db(b"turns")
        self._spills = self._open_db(b"spills")
        self._info = self._open_db(b"info")
        self._owners = self._open_db(b"owners")
        self._index_owners()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def map_size(self) -> int:
        return int(self._env.info()["map_size"])

    def close(self) -> None:
        """Close the environment; idempotent. Committed data is already on disk."""
        with self._gate.exclusive():
            if not self._closed:
                self._closed = True
                self._env.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- conversations ----------------------------------------------------------------------

    def commit_turn(
        self,
        conv_id: str,
        record: TurnRecord,
        keep_len: int,
        appended_tokens: Sequence[int],
        stateless: bool = False,
        final: bool = False,
        tenant: str | None = None,
    ) -> ConversationMeta:
        """Record a finished turn in one durable write transaction and return the new meta.

        The token log becomes `old_log[:keep_len] + appended_tokens`: keep_len equals the old
        length when the log only grows; it is smaller when re-rendering the chat template changed
        earlier tokens. `record.turn` must equal the number of turns already committed, and the
        conversation must not have ended. `stateless` and `tenant` are kept from the first turn;
        `final` ends the conversation.
        """
        key = codec.conversation_key(validate_conversation_id(conv_id))
        packed = codec.pack_tokens(appended_tokens)

        def apply(txn: lmdb.Transaction[bytes]) -> ConversationMeta:
            old = self._read_meta(txn, key)
            num_turns = old.num_turns if old else 0
            if old is not None and old.ended:
                raise ValueError(f"conversation {conv_id!r} has ended")
            if record.turn != num_turns:
                raise ValueError(
                    f"conversation {conv_id!r} has {num_turns} turns; cannot commit turn "
                    f"{record.turn}"
                )
            log = self._truncated_log(txn, key, conv_id, keep_len) + packed
            meta = ConversationMeta(
                conversation_id=conv_id,
                created_at=old.created_at if old else record.started_at,
                last_active=record.finished_at,
                num_turns=num_turns + 1,
                log_len=len(log) // 4,
                stateless=old.stateless if old else stateless,
                ended=final,
                tenant=old.tenant if old else tenant,
            )
            txn.put(key, log, db=self._logs)
            txn.put(codec.indexed_key(key, record.turn), codec.encode_turn(record), db=self._turns)
            txn.put(key, codec.encode_meta(meta), db=self._meta)
            if old is None:
                txn.put(codec.owner_prefix(tenant) + key, b"", db=self._owners)
            return meta

        return self._transact(apply, write=True)

    def create(
        self, conv_id: str, opening: Messages, created_at: float, tenant: str | None = None
    ) -> ConversationMeta:
        """Record a conversation with no turns yet, made with the messages `opening` (which its
        first turn continues), in one durable write; ValueError if the id is taken."""
        key = codec.conversation_key(validate_conversation_id(conv_id))
        meta = ConversationMeta(
            conv_id, created_at, created_at, 0, 0, tenant=tenant, opening=opening
        )

        def apply(txn: lmdb.Transaction[bytes]) -> ConversationMeta:
            if not txn.put(key, codec.encode_meta(meta), db=self._meta, overwrite=False):
                raise ValueError(f"conversation {conv_id!r} exists")
            txn.put(codec.owner_prefix(tenant) + key, b"", db=self._owners)
            return meta

        return self._transact(apply, write=True)

    def token_log(self, conv_id: str) -> list[int]:
        """Every prompt and generated token of the conversation, in order."""
        key = codec.conversation_key(validate_conversation_id(conv_id))
        data = self._transact(lambda txn: txn.get(key, db=self._logs), write=False)
        return codec.unpack_tokens(data) if data else []

    def turns(self, conv_id: str) -> list[TurnRecord]:
        key = codec.conversation_key(validate_conversation_id(conv_id))

        def read(txn: lmdb.Transaction[bytes]) -> list[TurnRecord]:
            return [codec.decode_turn(v) for _, v in _prefix_items(txn, self._turns, key)]

        return self._transact(read, write=False)

    def meta(self, conv_id: str) -> ConversationMeta | None:
        key = codec.conversation_key(validate_conversation_id(conv_id))
        return self._transact(lambda txn: self._read_meta(txn, key), write=False)

    def exists(self, conv_id: str) -> bool:
        return self.meta(conv_id) is not None

    def list_conversations(self) -> list[str]:
        """Ids of all conversations, sorted."""

        def read(txn: lmdb.Transaction[bytes]) -> list[str]:
            metas = (codec.decode_meta(v) for _, v in txn.cursor(db=self._meta))
            return sorted(m.conversation_id for m in metas)

        return self._transact(read, write=False)

    def list_page(
        self, after: bytes | None, limit: int, tenant: str | None = None
    ) -> tuple[list[str], bytes | None]:
        """Up to `limit` ids of `tenant`'s conversations (None: the service's own), in the
        store's key order, starting after the key `after` (None: from the first), and the key
        to continue after (None: no more). Reads `tenant`'s entries of the owner index only,
        however many conversations others have."""
        prefix = codec.owner_prefix(tenant)

        def read(txn: lmdb.Transaction[bytes]) -> tuple[list[str], bytes | None]:
            cursor = txn.cursor(db=self._owners)
            start = prefix + (after or b"")
            found = cursor.set_range(start)
            if found and after is not None and cursor.key() == start:
                found = cursor.next()
            ids: list[str] = []
            last = after
            while found and cursor.key().startswith(prefix):
                if len(ids) == limit:
                    return ids, last
                key = bytes(cursor.key()[len(prefix) :])
                meta = self._read_meta(txn, key)
                if meta is not None:  # written and deleted with it: always there
                    ids.append(meta.conversation_id)
                    last = key
                found = cursor.next()
            return ids, None

        return self._transact(read, write=False)

    def select(self, keep: Callable[[ConversationMeta], bool], limit: int) -> list[str]:
        """Ids of up to `limit` conversations whose meta `keep` accepts, in the store's order
        (one read transaction over every meta: for a periodic sweep, not a request)."""

        def read(txn: lmdb.Transaction[bytes]) -> list[str]:
            ids: list[str] = []
            for _, value in txn.cursor(db=self._meta):
                meta = codec.decode_meta(value)
                if keep(meta):
                    ids.append(meta.conversation_id)
                    if len(ids) == limit:
                        break
            return ids

        return self._transact(read, write=False)

    def used_bytes(self) -> int:
        """Bytes of the data file in use: up to its highest page. A delete frees pages that
        later writes reuse (the file never shrinks), so this stops growing once deletes keep
        pace with writes."""
        with self._gate.shared():
            info, stat = self._env.info(), self._env.stat()
        return (int(info["last_pgno"]) + 1) * int(stat["psize"])

    def delete(self, conv_id: str) -> bool:
        """Remove the conversation's log, turns, meta and spill entries; False if it was unknown."""
        key = codec.conversation_key(validate_conversation_id(conv_id))

        def apply(txn: lmdb.Transaction[bytes]) -> bool:
            meta = self._read_meta(txn, key)
            if meta is not None:
                txn.delete(codec.owner_prefix(meta.tenant) + key, db=self._owners)
            existed = txn.delete(key, db=self._meta)
            txn.delete(key, db=self._logs)
            for db in (self._turns, self._spills):
                for item_key in [k for k, _ in _prefix_items(txn, db, key)]:
                    txn.delete(item_key, db=db)
            return existed

        return self._transact(apply, write=True)

    def engine_id(self) -> str:
        """This store's engine id: 8 hex digits, made on first use and kept, so the conversations
        in the store and the engine serving them keep one name across restarts."""

        def apply(txn: lmdb.Transaction[bytes]) -> str:
            value = txn.get(b"engine_id", db=self._info)
            if value is None:
                value = secrets.token_hex(4).encode()
                txn.put(b"engine_id", value, db=self._info)
            return value.decode()

        return self._transact(apply, write=True)

    # --- CPU-tier spill index ---------------------------------------------------------------

    def put_spills(self, entries: Iterable[tuple[str, int, int]]) -> None:
        """Record that chunk `chunk_index` of `conv_id` sits in CPU slot `slot` (overwrites)."""
        self.update_spills(entries, ())

    def remove_spills(self, entries: Iterable[tuple[str, int]]) -> int:
        """Forget the given chunks' CPU slots; returns how many entries existed."""
        keys = [_chunk_key(conv_id, chunk_index) for conv_id, chunk_index in entries]

        def apply(txn: lmdb.Transaction[bytes]) -> int:
            return sum(txn.delete(key, db=self._spills) for key in keys)

        return self._transact(apply, write=True)

    def update_spills(
        self, puts: Iterable[tuple[str, int, int]], removes: Iterable[tuple[str, int]]
    ) -> None:
        """`remove_spills(removes)` and `put_spills(puts)` in one transaction (one disk sync)."""
        keys = [_chunk_key(conv_id, chunk_index) for conv_id, chunk_index in removes]
        rows = [
            (_chunk_key(conv_id, chunk_index), codec.encode_slot(_check_slot(slot)))
            for conv_id, chunk_index, slot in puts
        ]

        def apply(txn: lmdb.Transaction[bytes]) -> None:
            for key in keys:
                txn.delete(key, db=self._spills)
            for key, value in rows:
                txn.put(key, value, db=self._spills)

        self._transact(apply, write=True)

    def spills(self, conv_id: str) -> dict[int, int]:
        """chunk index -> CPU slot for the conversation's chunks in the CPU tier."""
        key = codec.conversation_key(validate_conversation_id(conv_id))

        def read(txn: lmdb.Transaction[bytes]) -> dict[int, int]:
            items = _prefix_items(txn, self._spills, key)
            return {codec.index_of(k): codec.decode_slot(v) for k, v in items}

        return self._transact(read, write=False)

    def clear_spills(self) -> None:
        """Empty the spill index: the CPU pool does not survive a restart."""
        self._transact(lambda txn: txn.drop(self._spills, delete=False), write=True)

    # --- internals --------------------------------------------------------------------------

    def _transact(self, fn: Callable[[lmdb.Transaction[bytes]], _T], write: bool) -> _T:
        """Run `fn` in one transaction, growing the map and retrying while it is full."""
        while True:
            try:
                with self._gate.shared():
                    if self._closed:
                        raise RuntimeError(f"conversation store {self._path} is closed")
                    with self._env.begin(write=write) as txn:
                        return fn(txn)
            except lmdb.MapFullError:
                self._resize(2 * self.map_size)
            except lmdb.MapResizedError:
                self._resize(0)  # another process grew the map: adopt its size

    def _index_owners(self) -> None:
        """Fill the owner index from the metas, once: a store written before the index had
        none (`commit_turn` and `delete` keep it from then on)."""

        def apply(txn: lmdb.Transaction[bytes]) -> None:
            if txn.get(b"owners_indexed", db=self._info) is not None:
                return
            for key, value in txn.cursor(db=self._meta):
                meta = codec.decode_meta(value)
                txn.put(codec.owner_prefix(meta.tenant) + key, b"", db=self._owners)
            txn.put(b"owners_indexed", b"1", db=self._info)

        self._transact(apply, write=True)

    def _open_db(self, name: bytes) -> lmdb._Database:
        # Creating a sub-database writes; reopening with a map_size below the data size leaves no
        # room for that, so this grows the map like any other write.
        while True:
            try:
                return self._env.open_db(name)
            except lmdb.MapFullError:
                self._resize(2 * self.map_size)

    def _resize(self, map_size: int) -> None:
        with self._gate.exclusive():
            self._env.set_mapsize(map_size)
        logger.info("LMDB map of %s is now %d bytes", self._path, self.map_size)

    def _read_meta(self, txn: lmdb.Transaction[bytes], key: bytes) -> ConversationMeta | None:
        data = txn.get(key, db=self._meta)
        return codec.decode_meta(data) if data is not None else None

    def _truncated_log(
        self, txn: lmdb.Transaction[bytes], key: bytes, conv_id: str, keep: int
    ) -> bytes:
        old = txn.get(key, db=self._logs) or b""
        if not 0 <= keep <= len(old) // 4:
            raise ValueError(
                f"keep_len={keep} is outside the token log of {conv_id!r} ({len(old) // 4} tokens)"
            )
        return bytes(old[: keep * 4])


def _prefix_items(
    txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes
) -> Iterator[tuple[bytes, bytes]]:
    cursor = txn.cursor(db=db)
    if not cursor.set_range(prefix):
        return
    for key, value in cursor:
        if not key.startswith(prefix):
            return
        yield key, value


def _chunk_key(conv_id: str, chunk_index: int) -> bytes:
    key = codec.conversation_key(validate_conversation_id(conv_id))
    if chunk_index < 0:
        raise ValueError(f"chunk index must be >= 0, got {chunk_index}")
    return codec.indexed_key(key, chunk_index)


def _check_slot(slot: int) -> int:
    if slot < 0:
        raise ValueError(f"CPU slot must be >= 0, got {slot}")
    return slot


def _restrict_file_modes(path: Path) -> None:
    """Conversations are private: make the LMDB files owner-only even if they pre-existed."""
    for name in ("data.mdb", "lock.mdb"):
        file = path / name
        if file.exists():
            os.chmod(file, FILE_MODE)
