"""The disk tier: chunks of KV in fixed slots of a preallocated file, mapped by an LMDB index.

Write order, so that a crash at any point leaves the index naming only complete chunks:

    1. take free slots (never one the index names)
    2. write the chunks' bytes into them
    3. fdatasync the slot file                  <- the bytes are durable
    4. put their entries, one LMDB transaction  <- only now does the index name them

A crash before 4 leaves bytes in slots no entry names: free again at the next start. Removing a
chunk goes the other way: its entry leaves the index (committed) before its slot is free to be
written. A chunk is read back only if its bytes pass the checksum its entry holds; one that does
not (torn by a crash the file system did not order, corrupted at rest) reads as missing and its
entry is dropped, so the caller recomputes it rather than use wrong KV.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pensieve.store.disk.directory import (
    INDEX_DIR,
    SLOT_FILE,
    DiskTierError,
    check_directory,
    file_size,
    lock_directory,
    size_slot_file,
)
from pensieve.store.disk.index import DiskIndex
from pensieve.store.disk.layout import (
    KEY_BYTES,
    LAYOUT_VERSION,
    ChunkGeometry,
    Entry,
    Header,
    checksum,
    fingerprint_digest,
    header_version,
)
from pensieve.store.disk.slot_io import IoMethod, Pieces, SlotIO, ThreadedSlotIO
from pensieve.store.disk.slot_map import SlotMap

logger = logging.getLogger(__name__)
Chunk = tuple[bytes, Pieces]  # a content key and the chunk's bytes, in order


@dataclass(frozen=True)
class DiskConfig:
    path: Path  # an existing, writable directory, for this engine alone
    budget_bytes: int  # a hard bound on the slot file
    io_method: IoMethod = IoMethod.AUTO
    num_threads: int = 8  # slots moved at once

    def num_slots(self, geometry: ChunkGeometry) -> int:
        return self.budget_bytes // geometry.slot_bytes


class DiskTier:
    """Chunks of one model's KV on disk, by content key. Safe to call from several threads;
    the I/O of a call runs on the tier's pool and the call returns when it is done."""

    def __init__(
        self,
        config: DiskConfig,
        geometry: ChunkGeometry,
        fingerprint: bytes,
        index: DiskIndex,
        slot_map: SlotMap,
        io: SlotIO,
        lock_fd: int,
    ) -> None:
        self.path = config.path
        self.geometry = geometry
        self._fingerprint = fingerprint
        self._index = index
        self._map = slot_map
        self._io = io
        self._lock_fd: int | None = lock_fd
        self._lock = threading.Lock()  # the slot map
        self._index_lock = threading.Lock()  # index writes, one at a time
        self.writable = True

    @classmethod
    def open(cls, config: DiskConfig, geometry: ChunkGeometry, model_fingerprint: str) -> DiskTier:
        """Open (or lay out) the tier in `config.path`, keeping the chunks a run before left
        there if the directory was laid out for this model and layout. A directory laid out for
        another model, geometry or layout version is laid out anew (its chunks could never be
        read by this one) with a log line; a missing, read-only or busy one is a DiskTierError."""
        path = config.path
        check_directory(path)
        num_slots = config.num_slots(geometry)
        if num_slots < 1:
            raise DiskTierError(f"a disk budget of {config.budget_bytes} bytes holds no chunk")
        lock_fd = lock_directory(path)
        index: DiskIndex | None = None
        try:
            fingerprint = fingerprint_digest(model_fingerprint)
            header = Header(LAYOUT_VERSION, fingerprint, geometry, num_slots)
            index = DiskIndex(path / INDEX_DIR, num_slots)
            file_slots = file_size(path / SLOT_FILE) // geometry.slot_bytes
            held = _load(index, header, file_slots, path)
            size_slot_file(path / SLOT_FILE, num_slots * geometry.slot_bytes)
            io = ThreadedSlotIO(path / SLOT_FILE, geometry, config.io_method, config.num_threads)
        except BaseException as error:
            if index is not None:
                index.close()
            os.close(lock_fd)
            if isinstance(error, OSError):
                raise DiskTierError(f"disk cache directory {path}: {error}") from error
            raise
        logger.info(
            "disk tier at %s: %d slots of %d bytes, %d chunks kept, %s I/O",
            path,
            num_slots,
            geometry.slot_bytes,
            len(held),
            io.method.value,
        )
        return cls(config, geometry, fingerprint, index, SlotMap(num_slots, held), io, lock_fd)

    @property
    def io_method(self) -> IoMethod:
        return self._io.method

    @property
    def num_slots(self) -> int:
        return self._map.num_slots

    @property
    def num_chunks(self) -> int:
        with self._lock:
            return self._map.num_held

    @property
    def num_free(self) -> int:
        with self._lock:
            return self._map.num_free

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._map

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._map.keys()

    def write(self, chunks: Sequence[Chunk]) -> list[bytes]:
        """Put chunks on disk as far as free slots go, in the order of the module's docstring;
        the keys written. A key on disk already is skipped (a content key names its bytes).
        Writes nothing once writes are off (after a write failed: disk full, I/O error). The
        chunks' buffers must not change until it returns."""
        pieces_of = dict(self._checked(chunks))
        if not self.writable:
            return []
        with self._lock:
            reserved = self._map.reserve(pieces_of)
        if not reserved:
            return []
        keys, slots = [key for key, _ in reserved], [slot for _, slot in reserved]
        entries = [
            (key, Entry(slot, checksum(key, pieces_of[key]), self._fingerprint))
            for key, slot in reserved
        ]
        try:
            errors = self._io.write(slots, [pieces_of[key] for key in keys])
            failed = next((error for error in errors if error is not None), None)
            if failed is not None:
                raise failed
            self._io.sync()
            with self._index_lock:
                self._index.update(puts=entries)
        except OSError as error:
            with self._lock:
                self._map.release(keys)
            self._stop_writes(error)
            return []
        with self._lock:
            for key, entry in entries:
                self._map.hold(key, entry)
        return keys

    def read(self, chunks: Sequence[Chunk]) -> list[bool]:
        """Read each chunk on disk into its buffers: whether each was read whole. One not on
        disk, unreadable or failing its checksum is missing (its buffers may have been written
        to), and a failing one's entry is dropped: the caller recomputes it."""
        chunks = self._checked(chunks)
        with self._lock:
            pinned = [self._map.pin(key) for key, _ in chunks]
        found = [False] * len(chunks)
        bad: list[tuple[bytes, Entry, str]] = []
        todo = [i for i, entry in enumerate(pinned) if entry is not None]
        try:
            errors = self._io.read([_slot(pinned[i]) for i in todo], [chunks[i][1] for i in todo])
            for i, error in zip(todo, errors, strict=True):
                key, pieces = chunks[i]
                entry = pinned[i]
                assert entry is not None
                if error is None and checksum(key, pieces) == entry.checksum:
                    found[i] = True
                else:
                    bad.append((key, entry, str(error) if error else "checksum mismatch"))
        finally:
            with self._lock:
                for i in todo:
                    self._map.unpin(_slot(pinned[i]))
        if bad:
            self._drop(bad)
        return found

    def remove(self, keys: Iterable[bytes]) -> int:
        """Forget these chunks (those on disk) and free their slots; how many there were."""
        with self._lock:
            detached = self._map.detach(keys)
        if detached:
            self._forget(detached)
        return len(detached)

    def close(self) -> None:
        """Release the directory (idempotent); callers stop calling the tier first."""
        if self._lock_fd is None:
            return
        self._io.close()
        self._index.close()
        os.close(self._lock_fd)
        self._lock_fd = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _checked(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        chunks = [(bytes(key), pieces) for key, pieces in chunks]
        for key, pieces in chunks:
            if len(key) != KEY_BYTES:
                raise ValueError(f"a chunk key has {KEY_BYTES} bytes, not {len(key)}")
            size = sum(memoryview(piece).nbytes for piece in pieces)
            if size != self.geometry.chunk_bytes:
                raise ValueError(f"a chunk has {self.geometry.chunk_bytes} bytes, not {size}")
        return chunks

    def _drop(self, bad: list[tuple[bytes, Entry, str]]) -> None:
        """Drop the entries of chunks that read back wrong (unless rewritten since)."""
        key, entry, why = bad[0]
        logger.warning(
            "disk tier at %s: %d chunks read back torn, corrupt or unreadable (slot %d: %s); "
            "they are dropped and recomputed",
            self.path,
            len(bad),
            entry.slot,
            why,
        )
        with self._lock:
            detached = self._map.detach(k for k, e, _ in bad if self._map.get(k) == e)
        if detached:
            self._forget(detached)

    def _forget(self, detached: list[tuple[bytes, Entry]]) -> None:
        try:
            with self._index_lock:
                self._index.update(removes=[key for key, _ in detached])
        except OSError as error:  # the entries may still name the slots: they stay unused
            self._stop_writes(error)
            return
        with self._lock:
            self._map.free(entry.slot for _, entry in detached)

    def _stop_writes(self, error: OSError) -> None:
        with self._lock:
            if not self.writable:
                return
            self.writable = False
        logger.error(
            "disk tier at %s: writes are off after a failed write (%s); chunks on disk are "
            "still read",
            self.path,
            error,
        )


def _slot(entry: Entry | None) -> int:
    assert entry is not None
    return entry.slot


def _load(index: DiskIndex, header: Header, file_slots: int, path: Path) -> dict[bytes, Entry]:
    """The entries a run before left that this one can read (dropping the rest from the index),
    or none, the directory laid out anew, if it was laid out for another model or layout."""
    stored = index.header()
    if stored is None:  # a fresh directory
        index.reset(header.encode())
        return {}
    old = Header.decode(stored)
    why = (
        old.foreign_to(header.fingerprint, header.geometry)
        if old is not None
        else f"layout version {header_version(stored)} (this build: {LAYOUT_VERSION})"
    )
    if old is None or why is not None:
        logger.warning(
            "disk tier: %s holds chunks of %s; they are not loaded, and the directory is laid "
            "out anew",
            path,
            why,
        )
        index.reset(header.encode())
        return {}
    limit = min(header.num_slots, file_slots)  # past the file's end: never written whole
    held: dict[bytes, Entry] = {}
    slots: set[int] = set()
    drops = []
    for key, value in index.entries().items():
        entry = Entry.decode(value)
        if (
            entry is None
            or len(key) != KEY_BYTES
            or entry.fingerprint != header.fingerprint
            or entry.layout_version != LAYOUT_VERSION
            or not 0 <= entry.slot < limit
            or entry.slot in slots
        ):
            drops.append(key)
            continue
        slots.add(entry.slot)
        held[key] = entry
    if drops:
        logger.warning(
            "disk tier at %s: %d chunks dropped (past the budget or the slot file's end)",
            path,
            len(drops),
        )
    if drops or old.num_slots != header.num_slots:
        index.update(removes=drops, header=header.encode())
    return held
