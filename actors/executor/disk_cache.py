"""The executor's disk tier in service: chunks leaving the CPU tier go to disk in the background,
and chunks a turn needs come back from it, read when the turn arrives.

    step N's copies reuse CPU slot s  --save-->  snapshot (host memory)  --writer thread-->  disk
    turn arrives  --read-->  reader thread: disk (or a snapshot not yet written) -> staged buffer
    the turn is admitted  --load-->  staged buffer -> its GPU block, in place of recomputing

`save` copies the slot's bytes (a memcpy, no I/O) before the step's copies may reuse it; the
disk write, its fdatasync and the index commit run on the writer thread. On CUDA it never waits
for the device's compute: a CPU slot is copied once the copy streams (`copy_streams`: the swap
engine's, the only writers of CPU slots) are done with it, a GPU block by a device-to-host copy
queued behind the step in flight, whose event the writer and reader threads wait on. A turn
waits in the queue only for its own read. A chunk the tier cannot give back whole (never
written, dropped for room, failing its checksum) is not `found`, and the turn recomputes it:
where a chunk's KV comes from never changes a token.

Which chunks the tier keeps is the scheduler's choice, by the retention value (`actors/
scheduler/kv/disk_books.py`): a step's orders name the keys to remove (`disk_drop`) before the
chunks to save in their place, and the writer thread takes both in that order, so the tier holds
no more chunks than the scheduler's books. A save that finds no free slot is not written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pensieve.actors.executor.disk_views import host_blocks
from pensieve.actors.wire.step import DiskLoad, DiskSave
from pensieve.store.disk import DiskTier

logger = logging.getLogger(__name__)
MAX_BATCH = 64  # chunks per disk write: one fdatasync and one index transaction each
READ_RATE_DECAY = 0.8  # the weight of the reads before, at each read, in the measured rate


@dataclass(frozen=True)
class _Removal:
    keys: list[bytes]


@dataclass(eq=False)
class _Snapshot:
    """A chunk's bytes kept for the disk; `copied`: the event after the device-to-host copy
    that fills `buffer` (a GPU block's snapshot on CUDA), None if it is filled already."""

    buffer: torch.Tensor
    copied: torch.cuda.Event | None = None

    def bytes(self) -> torch.Tensor:
        """The buffer, once filled (waits for its copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.buffer


_Save = tuple[bytes, _Snapshot]  # a content key and the chunk's bytes


class DiskCache:
    """The disk tier beside the runner's KV tiers (`gpu_caches`, `cpu_caches`: per layer
    [num_blocks, 2, block_size, Hkv, D]). Its methods are called from the engine's thread;
    the I/O runs on its own two threads."""

    def __init__(
        self,
        tier: DiskTier,
        gpu_caches: Sequence[torch.Tensor],
        cpu_caches: Sequence[torch.Tensor],
        read_bytes_per_s: float,
        measure: bool = True,
        copy_streams: Sequence[torch.cuda.Stream] = (),
    ) -> None:
        self.tier = tier
        self.gpu_caches = gpu_caches
        self.cpu_caches = cpu_caches
        # the read rate that weighs reading a chunk against recomputing it: `read_bytes_per_s`,
        # or with `measure` once the tier has read, the decayed bytes over seconds of its own
        # reads (I/O and checksums, as a turn waits for them)
        self.read_bytes_per_s = read_bytes_per_s
        self._measure = measure
        self._read_bytes = self._read_s = 0.0
        self._pin = gpu_caches[0].is_cuda
        # on CUDA, the streams whose copies write CPU slots and read GPU blocks (the swap
        # engine's); none given: the whole device is waited for in their place
        self.copy_streams = tuple(copy_streams)
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Snapshot] = {}  # saved, not yet on disk
        self._staged: dict[bytes, tuple[torch.Tensor, int]] = {}  # read: buffer, readers
        self._writes: queue.Queue[_Save | _Removal | None] = queue.Queue()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="disk-read")
        self._writer = threading.Thread(target=self._write_loop, name="disk-write", daemon=True)
        self._writer.start()
        self.num_saved = self.num_written = self.num_read = self.num_missed = 0

    @property
    def read_seconds_per_chunk(self) -> float:
        return self.tier.geometry.chunk_bytes / self.read_bytes_per_s

    @property
    def num_slots(self) -> int:
        return self.tier.num_slots

    @property
    def writable(self) -> bool:
        return self.tier.writable

    def keys(self) -> list[bytes]:
        """The chunks on disk and those saved for it, not yet written."""
        with self._lock:
            pending = list(self._pending)
        return list(dict.fromkeys([*self.tier.keys(), *pending]))

    # ---- on a step's path: no I/O ----------------------------------------------------------

    def drop(self, keys: Collection[bytes]) -> None:
        """Remove these chunks from disk, before any save ordered after them (to make room for
        it: nothing is removed once writes are off)."""
        if not keys or not self.tier.writable:
            return
        with self._lock:
            for key in keys:  # a save of it ordered later is written again
                self._pending.pop(key, None)
        self._writes.put(_Removal(list(keys)))

    def save(self, saves: Collection[DiskSave]) -> None:
        """Keep the bytes of these CPU slots and GPU blocks for the disk (before the step's
        copies run)."""
        if not saves or not self.tier.writable:
            return
        if self._pin and any(save.cpu_slot is not None for save in saves):
            self._copies_done()  # an earlier step's copy into a slot may still be running
        copied = torch.cuda.Event() if self._pin else None
        for save in saves:
            if save.cpu_slot is not None:
                self._queue(save.key, _Snapshot(self._snapshot(self.cpu_caches, save.cpu_slot)))
            else:
                assert save.gpu_block is not None
                # behind the step in flight on the compute stream, before this step's copies
                # and compute (issued after this) may write into the block
                buffer = self._snapshot(self.gpu_caches, save.gpu_block, non_blocking=True)
                self._queue(save.key, _Snapshot(buffer, copied))
        if copied is not None:
            copied.record()

    def load(self, loads: Collection[DiskLoad]) -> None:
        """Copy staged chunks into their GPU blocks (after the step's own copies are issued)."""
        if not loads:
            return
        if self._pin:  # after the step's evict-first copies out of these blocks (device-side)
            compute = torch.cuda.current_stream()
            for stream in self.copy_streams:
                compute.wait_stream(stream)
            if not self.copy_streams:
                torch.cuda.synchronize(self.gpu_caches[0].device)
        for load in loads:
            buffer, _ = self._staged[load.key]
            for layer, cache in enumerate(self.gpu_caches):
                block = cache[load.gpu_block].view(torch.uint8).view(-1)
                block.copy_(buffer[layer], non_blocking=True)

    # ---- reads, started when a turn arrives ------------------------------------------------

    def read(self, keys: Collection[bytes]) -> DiskRead | None:
        with self._lock:
            wanted = [k for k in dict.fromkeys(keys) if k in self._pending or k in self.tier]
        if not wanted:
            return None
        read = DiskRead(self)
        read.future = self._reader.submit(self._read, wanted)
        return read

    def _read(self, keys: list[bytes]) -> frozenset[bytes]:
        found: dict[bytes, torch.Tensor] = {}
        todo: list[tuple[bytes, torch.Tensor]] = []
        waits: list[_Snapshot] = []
        with self._lock:
            for key in keys:
                staged = self._staged.get(key)
                pending = self._pending.get(key)
                if staged is not None:
                    found[key] = staged[0]
                elif pending is not None:
                    found[key] = pending.buffer  # a snapshot never changes once taken
                    waits.append(pending)
                else:
                    todo.append((key, self._buffer()))
        for snapshot in waits:  # one being copied off the GPU: its bytes once there
            snapshot.bytes()
        if todo:
            begin = time.perf_counter()
            whole = self.tier.read([(key, _pieces(buffer)) for key, buffer in todo])
            self._measured(len(todo) * self.tier.geometry.chunk_bytes, time.perf_counter() - begin)
            found.update((key, buf) for (key, buf), ok in zip(todo, whole, strict=True) if ok)
        with self._lock:
            for key, buffer in found.items():
                held = self._staged.get(key)
                self._staged[key] = (buffer, 1) if held is None else (held[0], held[1] + 1)
            self.num_read += len(found)
            self.num_missed += len(keys) - len(found)
        return frozenset(found)

    def _measured(self, num_bytes: int, seconds: float) -> None:
        """A read's bytes and time, in the rate (older reads weigh less and less)."""
        self._read_bytes = READ_RATE_DECAY * self._read_bytes + num_bytes
        self._read_s = READ_RATE_DECAY * self._read_s + seconds
        if self._measure and self._read_s > 0:
            self.read_bytes_per_s = self._read_bytes / self._read_s

    def unstage(self, keys: Collection[bytes]) -> None:
        with self._lock:
            for key in keys:
                buffer, readers = self._staged[key]
                if readers > 1:
                    self._staged[key] = (buffer, readers - 1)
                else:
                    del self._staged[key]

    # ---- writes, on the writer thread ------------------------------------------------------

    def write_back(
        self,
        drops: Collection[bytes],
        cpu: Collection[tuple[int, bytes]],
        gpu: Collection[tuple[int, bytes]],
    ) -> int:
        if self.tier.writable:
            self.drop(drops)
            for caches, places in ((self.cpu_caches, cpu), (self.gpu_caches, gpu)):
                for index, key in places:
                    if key not in self.tier:
                        self._queue(key, _Snapshot(self._snapshot(caches, index)))
        self.flush()
        return sum(key in self.tier for _, key in (*cpu, *gpu))

    def flush(self) -> None:
        """Wait until every chunk saved so far is written (or given up)."""
        self._writes.join()

    def close(self) -> None:
        """Write what is saved, stop the threads and release the directory."""
        self.flush()
        self._writes.put(None)
        self._writer.join()
        self._reader.shutdown(wait=True)
        self.tier.close()

    def _queue(self, key: bytes, snapshot: _Snapshot) -> None:
        with self._lock:
            if key in self._pending:
                return
            self._pending[key] = snapshot
        self.num_saved += 1
        self._writes.put((key, snapshot))

    def _write_loop(self) -> None:
        carried: _Save | _Removal | None = None  # taken from the queue after a batch of saves
        while True:
            item = carried if carried is not None else self._writes.get()
            carried = None
            if item is None:
                self._writes.task_done()
                return
            if isinstance(item, _Removal):
                self._remove(item.keys)
                continue
            batch = [item]
            while len(batch) < MAX_BATCH:
                try:
                    more = self._writes.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._writes.put(None)  # stop after this batch
                    self._writes.task_done()
                    break
                if isinstance(more, _Removal):
                    carried = more
                    break
                batch.append(more)
            self._write_batch(batch)

    def _remove(self, keys: list[bytes]) -> None:
        try:
            if self.tier.writable:
                self.tier.remove(keys)
        except Exception:  # noqa: BLE001 - a cache's removal: log, never stop serving
            logger.exception("disk tier: a removal failed")
        finally:
            self._writes.task_done()

    def _write_batch(self, batch: list[_Save]) -> None:
        try:
            self._write(batch)
        except Exception:  # noqa: BLE001 - a write is a cache fill: log, never stop serving
            logger.exception("disk tier: a write-back batch failed")
        finally:
            with self._lock:
                for key, snapshot in batch:
                    if self._pending.get(key) is snapshot:
                        del self._pending[key]
            for _ in batch:
                self._writes.task_done()

    def _write(self, batch: list[_Save]) -> None:
        """Write what fits in free slots (the scheduler removed chunks to make room first)."""
        chunks = [(key, snap) for key, snap in batch if key not in self.tier]
        if not chunks or not self.tier.writable:
            return
        written = self.tier.write([(key, _pieces(snap.bytes())) for key, snap in chunks])
        with self._lock:
            self.num_written += len(written)

    # ---- buffers ---------------------------------------------------------------------------

    def _buffer(self) -> torch.Tensor:
        geometry = self.tier.geometry
        # [num_layers, layer_bytes]: a chunk's bytes as a slot holds them
        return host_blocks((geometry.num_layers, geometry.layer_bytes), torch.uint8, self._pin)

    def _snapshot(
        self, caches: Sequence[torch.Tensor], index: int, non_blocking: bool = False
    ) -> torch.Tensor:
        buffer = self._buffer()
        for layer, cache in enumerate(caches):
            buffer[layer].copy_(cache[index].view(torch.uint8).view(-1), non_blocking=non_blocking)
        return buffer

    def _copies_done(self) -> None:
        """Wait until the copies issued so far are done (not the compute)."""
        for stream in self.copy_streams:
            stream.synchronize()
        if not self.copy_streams:
            torch.cuda.synchronize(self.gpu_caches[0].device)


class DiskRead:
    """One turn's read (`DiskCache.read`); see `actors.wire.step.DiskRead`."""

    def __init__(self, cache: DiskCache) -> None:
        self.cache = cache
        self.future: Future[frozenset[bytes]] | None = None
        self._released = False

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def wait(self, timeout: float) -> bool:
        if self.future is None:
            return False
        return not concurrent.futures.wait([self.future], timeout).not_done

    def found(self) -> frozenset[bytes]:
        assert self.future is not None
        if self._released:
            return frozenset()
        try:
            return self.future.result()
        except Exception:  # noqa: BLE001 - an unreadable tier: the turn recomputes
            logger.exception("disk tier: a read failed; its chunks are recomputed")
            return frozenset()

    def release(self) -> None:
        if self._released or self.future is None:
            return
        found = self.found()
        self._released = True
        self.cache.unstage(found)


def _pieces(buffer: torch.Tensor) -> list[memoryview]:
    return [memoryview(row.numpy().data) for row in buffer]
