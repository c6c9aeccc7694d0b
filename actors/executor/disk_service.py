"""The executor's disk tier (`DiskCache`) served to a scheduler in another process, over the
subjects of `actors/wire/disk_messages.py`: reads started when a turn arrives and answered once
done, the keys on disk, and a clean stop's write-back.

A read's chunks stay staged until the scheduler releases the read, on the step channel behind
the plan that loads them (`release`, on the executor's worker thread). A release may overtake
its read's request, which then reads nothing; a reset (a scheduler that starts, or one that
recovers from a failed step) releases every read, so a scheduler that went away leaves none
staged.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

from pensieve.actors.executor.disk_cache import DiskCache, DiskRead
from pensieve.actors.wire.disk_messages import (
    DiskInfo,
    ReadAnswer,
    ReadRequest,
    WriteBackAnswer,
    WriteBackRequest,
    keys_pages,
)
from pensieve.actors.wire.incoming import Incoming


class DiskService:
    def __init__(self, cache: DiskCache, bus: Any) -> None:
        self.cache = cache
        self.bus = bus
        self._lock = threading.Lock()
        self._reads: dict[str, DiskRead] = {}  # started, not yet released
        self._released: set[str] = set()  # released before their request came

    def info(self) -> DiskInfo:
        cache = self.cache
        return DiskInfo(cache.num_slots, cache.read_seconds_per_chunk, cache.writable)

    def figures(self) -> list[float]:
        return self.info().figures()

    # ---- on the event loop -----------------------------------------------------------------

    async def on_read(self, msg: Incoming) -> None:
        request = ReadRequest.decode(msg.data)
        found = await self._read(request.read, request.keys)
        await msg.send(ReadAnswer(request.read, sorted(found)).encode())

    async def _read(self, name: str, keys: list[bytes]) -> frozenset[bytes]:
        with self._lock:
            if name in self._released:  # its turn ended before the read began
                self._released.discard(name)
                return frozenset()
            read = self.cache.read(keys)
            if read is None:
                return frozenset()
            self._reads[name] = read
        assert read.future is not None
        with contextlib.suppress(Exception):  # a failed read finds nothing (`found` logs it)
            await asyncio.wrap_future(read.future)
        return read.found()  # nothing, if released meanwhile

    async def on_keys(self, msg: Incoming) -> None:
        keys = await asyncio.to_thread(self.cache.keys)  # the index is LMDB's
        for page in keys_pages(keys, self.bus.max_payload):
            await msg.send(page.encode())

    # ---- on the worker thread, in order with the steps --------------------------------------

    def release(self, names: Collection[str]) -> None:
        with self._lock:
            reads = []
            for name in names:
                read = self._reads.pop(name, None)
                if read is None:
                    self._released.add(name)
                else:
                    reads.append(read)
        _release(reads)

    def release_all(self) -> None:
        with self._lock:
            reads, self._reads = list(self._reads.values()), {}
            self._released.clear()
        _release(reads)

    def write_back(self, request: WriteBackRequest) -> WriteBackAnswer:
        """Remove and write as the request says, and wait until the writes are durable (after
        the steps before it: their copies are settled)."""
        return WriteBackAnswer(self.cache.write_back(request.drops, request.cpu, request.gpu))


def _release(reads: list[DiskRead]) -> None:
    for read in reads:  # one still reading lets go of its chunks once it is done
        assert read.future is not None
        read.future.add_done_callback(_releaser(read))


def _releaser(read: DiskRead) -> Callable[[Future[frozenset[bytes]]], None]:
    return lambda _: read.release()
