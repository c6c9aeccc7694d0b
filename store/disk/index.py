"""The disk tier's map in LMDB: the directory's header and one entry per chunk on disk.

It lives in the cache directory itself (`<dir>/index`), beside the slot file it describes, so a
directory is whole on its own: moved, mounted as a volume or wiped, the map goes with the data.

    sub-database  key                       value
    info          b"header"                 `Header` (layout version, fingerprint, geometry,
                                            number of slots)
    chunks        content key (16 bytes)    `Entry` (slot, checksum, fingerprint, layout version)

Every method is one transaction, synced at commit. The tier calls the writing ones from one
thread at a time (it holds a lock), which also lets the map grow between transactions.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import lmdb

from pensieve.store.disk.layout import Entry

logger = logging.getLogger(__name__)
FILE_MODE = 0o600
_T = TypeVar("_T")
_MIN_MAP_SIZE = 16 * 2**20
_ENTRY_ROOM = 256  # map bytes to allow per chunk (record, B-tree and free pages)


class DiskIndex:
    def __init__(self, path: Path, num_slots: int) -> None:
        path.mkdir(mode=0o700, exist_ok=True)
        try:
            self._env = lmdb.open(
                str(path),
                map_size=max(_MIN_MAP_SIZE, num_slots * _ENTRY_ROOM),
                max_dbs=2,
                mode=FILE_MODE,
                readahead=False,
            )
            self._info = self._env.open_db(b"info")
            self._chunks = self._env.open_db(b"chunks")
        except lmdb.Error as error:
            raise OSError(errno.EIO, f"LMDB: {error}") from error

    def close(self) -> None:
        self._env.close()

    def header(self) -> bytes | None:
        return self._transact(lambda txn: txn.get(b"header", db=self._info), write=False)

    def entries(self) -> dict[bytes, bytes]:
        """Every chunk's entry, as stored (content key -> encoded `Entry`)."""

        def read(txn: lmdb.Transaction[bytes]) -> dict[bytes, bytes]:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=self._chunks)}

        return self._transact(read, write=False)

    def reset(self, header: bytes) -> None:
        """Forget every chunk and write `header`, in one transaction."""

        def apply(txn: lmdb.Transaction[bytes]) -> None:
            txn.drop(self._chunks, delete=False)
            txn.put(b"header", header, db=self._info)

        self._transact(apply, write=True)

    def update(
        self,
        puts: Iterable[tuple[bytes, Entry]] = (),
        removes: Iterable[bytes] = (),
        header: bytes | None = None,
    ) -> None:
        """Remove entries, put entries and set the header, in one transaction."""
        rows = [(key, entry.encode()) for key, entry in puts]
        keys = list(removes)

        def apply(txn: lmdb.Transaction[bytes]) -> None:
            for key in keys:
                txn.delete(key, db=self._chunks)
            for key, value in rows:
                txn.put(key, value, db=self._chunks)
            if header is not None:
                txn.put(b"header", header, db=self._info)

        self._transact(apply, write=True)

    def _transact(self, fn: Callable[[lmdb.Transaction[bytes]], _T], write: bool) -> _T:
        while True:
            try:
                with self._env.begin(write=write) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                size = 2 * int(self._env.info()["map_size"])
                self._env.set_mapsize(size)
                logger.info("disk tier: its index map is now %d bytes", size)
            except lmdb.Error as error:  # a full or failing disk: an I/O error to the tier
                raise OSError(errno.EIO, f"LMDB: {error}") from error
