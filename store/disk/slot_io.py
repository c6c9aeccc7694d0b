"""Moves chunks between memory and the slot file: many scattered slots at once.

The I/O method is pluggable (`SlotIO`): the tier hands over a batch of slots and the buffers of
their chunks and gets one error (or None) per slot back, so a method that submits a whole batch
at once (io_uring, kvikio) fits behind the same call. `ThreadedSlotIO` makes one pwritev or
preadv per slot on a pool of threads (the calls release the GIL), with O_DIRECT where the file
system takes it: the page cache would hold a second copy of what the CPU tier holds already.

Direct I/O moves whole aligned slots between aligned buffers. A chunk whose pieces are all
ALIGN-aligned in address and length (pinned CPU-tier blocks of most models are) goes straight
from and into them; any other goes through an aligned staging buffer of the worker thread.
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from pensieve.store.disk.layout import ALIGN, ChunkGeometry

logger = logging.getLogger(__name__)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
Pieces = Sequence[memoryview]  # one chunk's bytes, in order (C-contiguous buffers)


class IoMethod(enum.Enum):
    AUTO = "auto"  # direct I/O where the file system takes it, else buffered
    DIRECT = "direct"  # O_DIRECT: no page cache; aligned offsets, lengths and buffers
    BUFFERED = "buffered"  # through the page cache


class SlotIO(Protocol):
    """Writes and reads whole chunks at slots of the slot file."""

    method: IoMethod  # the one in use: DIRECT or BUFFERED

    def write(self, slots: Sequence[int], chunks: Sequence[Pieces]) -> list[OSError | None]:
        """Write each chunk at its slot; the error of each (None: written, not yet durable)."""
        ...

    def read(self, slots: Sequence[int], chunks: Sequence[Pieces]) -> list[OSError | None]:
        """Read each slot into its chunk's buffers; the error of each (None: read whole)."""
        ...

    def sync(self) -> None:
        """Make every write returned so far durable (raises OSError)."""
        ...

    def close(self) -> None: ...


def aligned_buffer(num_bytes: int) -> memoryview:
    """Zeroed memory at a page boundary (an anonymous mapping), for direct I/O."""
    return memoryview(mmap.mmap(-1, num_bytes))


def is_aligned(pieces: Pieces) -> bool:
    """Whether direct I/O can move these buffers as they are."""
    return all(
        len(p) % ALIGN == 0 and np.frombuffer(p, dtype=np.uint8).ctypes.data % ALIGN == 0
        for p in pieces
    )


class ThreadedSlotIO:
    """One pwritev or preadv per slot, on `num_threads` threads (see the module's docstring)."""

    def __init__(
        self, path: Path, geometry: ChunkGeometry, method: IoMethod, num_threads: int
    ) -> None:
        self.geometry = geometry
        self.method, self._fd = _open(path, method, geometry.slot_bytes)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="disk-io")
        self._local = threading.local()  # each worker's staging buffer, made on first use

    def write(self, slots: Sequence[int], chunks: Sequence[Pieces]) -> list[OSError | None]:
        return self._run(self._write_one, slots, chunks)

    def read(self, slots: Sequence[int], chunks: Sequence[Pieces]) -> list[OSError | None]:
        return self._run(self._read_one, slots, chunks)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self._fd)

    def _run(
        self, fn: Callable[[int, Pieces], None], slots: Sequence[int], chunks: Sequence[Pieces]
    ) -> list[OSError | None]:
        futures = [self._pool.submit(fn, s, c) for s, c in zip(slots, chunks, strict=True)]
        return [_os_error(f) for f in futures]

    def _write_one(self, slot: int, pieces: Pieces) -> None:
        if self.method is IoMethod.DIRECT and not is_aligned(pieces):
            staging = self._staging()
            _gather(staging, pieces)
            pieces = [staging]  # the whole slot: its padding stays zero
        _transfer(os.pwritev, self._fd, pieces, slot * self.geometry.slot_bytes)

    def _read_one(self, slot: int, pieces: Pieces) -> None:
        offset = slot * self.geometry.slot_bytes
        if self.method is IoMethod.DIRECT and not is_aligned(pieces):
            staging = self._staging()
            _transfer(os.preadv, self._fd, [staging], offset)
            _scatter(staging, pieces)
        else:
            _transfer(os.preadv, self._fd, pieces, offset)

    def _staging(self) -> memoryview:
        buffer: memoryview | None = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = aligned_buffer(self.geometry.slot_bytes)
        return buffer


def _open(path: Path, method: IoMethod, slot_bytes: int) -> tuple[IoMethod, int]:
    """The slot file opened for `method` (AUTO: direct I/O if a probe read passes)."""
    plain = os.O_RDWR | os.O_CLOEXEC
    if method is IoMethod.BUFFERED:
        return method, os.open(path, plain)
    try:
        fd = os.open(path, plain | os.O_DIRECT)
    except OSError as error:
        return _fall_back(path, method, error)
    try:  # some file systems open with O_DIRECT and refuse the I/O
        _transfer(os.preadv, fd, [aligned_buffer(ALIGN)], 0)
    except OSError as error:
        os.close(fd)
        return _fall_back(path, method, error)
    return IoMethod.DIRECT, fd


def _fall_back(path: Path, method: IoMethod, error: OSError) -> tuple[IoMethod, int]:
    if method is IoMethod.DIRECT or error.errno != errno.EINVAL:
        raise error
    logger.info("disk tier: %s takes no direct I/O (%s); it uses buffered I/O", path, error)
    return IoMethod.BUFFERED, os.open(path, os.O_RDWR | os.O_CLOEXEC)


def _transfer(
    call: Callable[[int, list[memoryview], int], int], fd: int, pieces: Pieces, offset: int
) -> None:
    """pwritev or preadv all of `pieces` at `offset`, continuing after partial transfers."""
    views = [memoryview(p).cast("B") for p in pieces]
    while views:
        moved = call(fd, views[:_IOV_MAX], offset)
        if moved <= 0:  # a read past the file's end
            raise OSError(errno.EIO, f"short transfer at byte {offset}")
        offset += moved
        while views and moved >= len(views[0]):
            moved -= len(views.pop(0))
        if moved:
            views[0] = views[0][moved:]


def _gather(staging: memoryview, pieces: Pieces) -> None:
    at = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        staging[at : at + len(view)] = view
        at += len(view)


def _scatter(staging: memoryview, pieces: Pieces) -> None:
    at = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        view[:] = staging[at : at + len(view)]
        at += len(view)


def _os_error(future: Future[None]) -> OSError | None:
    error = future.exception()
    if error is None or isinstance(error, OSError):
        return error
    raise error
