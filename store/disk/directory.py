"""The cache directory an operator gives the disk tier: its checks, its lock and its slot file.

    <dir>/LOCK        held (flock) by the one process that serves from the directory
    <dir>/index/      the map (LMDB, see `index.py`)
    <dir>/slots.bin   the slots, preallocated to the budget

The tier touches no other name in the directory, so a volume's lost+found or an operator's
files beside these are left alone.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)
LOCK_FILE = "LOCK"
INDEX_DIR = "index"
SLOT_FILE = "slots.bin"
FILE_MODE = 0o600


class DiskTierError(Exception):
    """The disk tier cannot start on the directory it was given."""


def check_directory(path: Path) -> None:
    """A clear error unless `path` is an existing directory this process may write."""
    if not path.exists():
        raise DiskTierError(f"disk cache directory {path} does not exist")
    if not path.is_dir():
        raise DiskTierError(f"disk cache directory {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise DiskTierError(f"disk cache directory {path} is not writable (read-only?)")


def lock_directory(path: Path) -> int:
    """Hold the directory for this process (released when the descriptor closes, or the
    process dies); a clear error if another process holds it."""
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError as error:
        raise DiskTierError(f"disk cache directory {path} is not writable: {error}") from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskTierError(
            f"disk cache directory {path} is in use by another process: give each engine its own"
        ) from None
    return fd


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def size_slot_file(path: Path, size: int) -> None:
    """Create, grow or shrink the slot file to `size` bytes, durably. Growth is preallocated
    where the file system can (so later writes cannot find the disk full); where it cannot
    (too little free space, no fallocate), the file is sparse and a write may fail later,
    which turns the tier's writes off."""
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        old = os.fstat(fd).st_size
        if old < size:
            _preallocate(fd, path, old, size)
        elif old > size:
            os.ftruncate(fd, size)
        if old != size:
            os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the file's name durable too
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _preallocate(fd: int, path: Path, begin: int, end: int) -> None:
    try:
        os.posix_fallocate(fd, begin, end - begin)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, end)
        logger.warning(
            "disk tier: could not reserve %d bytes for %s (%s): the file is sparse, and writes "
            "stop if the file system fills",
            end - begin,
            path,
            error.strerror,
        )
