"""The executor's disk tier in service: chunks leaving the CPU tier go to disk in the background,
and chunks a turn needs come back from it, read when the turn arrives.

    CPU slot s leaves the tiers  --save-->  snapshot (host memory)  --writer thread-->  disk
    turn arrives  --read-->  reader thread: disk (or a snapshot not yet written) -> staged buffer
    the turn is admitted  --load-->  staged buffer -> its GPU block, in place of recomputing

`save` does no I/O and copies nothing on the engine's thread: a CPU slot's bytes are copied into
the snapshot by the first thread that needs them (the writer, a reader, or the engine itself
when a later step's copy is about to reuse the slot: `before_overwrite`), once the copy streams
(`copy_streams`: the swap engine's, the only writers of CPU slots) have finished the copies
issued before the save; a GPU block's by a device-to-host copy queued behind the step in flight,
whose event the writer and reader threads wait on. The disk write, its fdatasync and the index
commit run on the writer thread. Snapshots take buffers from a pool of host buffers made at
start (pinned on CUDA, so that taking one never allocates pinned memory on a step's path), a
slot's when it is copied. A GPU block's save that finds the pool empty (the disk writes slower
than chunks leave the tiers) is not written, like one that finds no free slot, and so is a
slot's that the engine must copy then; the writer and readers make a buffer of their own.
The scheduler saves most chunks while they still sit in their slots, ahead of their eviction
(`actors/scheduler/kv/disk_saves.py`), so the writer copies them, not the engine. A turn
waits in the queue only for its own read. A chunk the tier cannot give back whole (never
written, dropped for room, failing its checksum) is not `found`,
and the turn recomputes it: where a chunk's KV comes from never changes a token.

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
from dataclasses import dataclass, field

import torch

from pensieve.actors.executor.disk_views import host_blocks
from pensieve.actors.wire.step import DiskLoad, DiskSave
from pensieve.store.disk import DiskTier

logger = logging.getLogger(__name__)
MAX_BATCH = 64  # chunks per disk write: one fdatasync and one index transaction each
POOL_BYTES = 1 << 30  # snapshot buffers: at most this many bytes of chunks waiting for the disk
POOL_CHUNKS = (16, 256)  # and between these many chunks
READ_RATE_DECAY = 0.8  # the weight of the reads before, at each read, in the measured rate


@dataclass(frozen=True)
class _Removal:
    keys: list[bytes]


@dataclass(eq=False)
class _Snapshot:
    """A chunk's bytes kept for the disk in `buffer`, filled one of three ways: already (None,
    None), by a device-to-host copy whose event is `copied` (a GPU block's, on CUDA), or from
    CPU slot `slot` once the copies issued before the save (`after`) are done, by the first
    thread that needs it (`DiskCache._take`; `slot` is None once it is taken). `pooled`: the
    buffer goes back to the pool once written (a read copies it out first)."""

    buffer: torch.Tensor | None  # None once the writer has given it back
    copied: torch.cuda.Event | None = None
    slot: int | None = None
    after: tuple[torch.cuda.Event, ...] = ()
    pooled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        self._slot_saves: dict[int, _Snapshot] = {}  # saved CPU slots, not yet copied
        geometry = tier.geometry
        low, high = POOL_CHUNKS
        self._pool_size = max(low, min(high, POOL_BYTES // geometry.chunk_bytes))
        self._pool: list[torch.Tensor] = []  # free snapshot buffers (on CUDA, made at start)
        self._lent = 0  # buffers out of the pool
        if self._pin:
            arena = host_blocks(
                (self._pool_size, geometry.num_layers, geometry.layer_bytes), torch.uint8, True
            )
            self._pool = list(arena.unbind(0))
        self._writes: queue.Queue[_Save | _Removal | None] = queue.Queue()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="disk-read")
        self._writer = threading.Thread(target=self._write_loop, name="disk-write", daemon=True)
        self._writer.start()
        self.num_saved = self.num_written = self.num_read = self.num_missed = 0
        self.num_skipped = 0  # saves not written: no snapshot buffer free

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
        """Keep these CPU slots and GPU blocks for the disk (before the step's copies run):
        nothing is copied here on the host, and nothing waits for the device."""
        if not saves or not self.tier.writable:
            return
        after: tuple[torch.cuda.Event, ...] = ()
        if self._pin and any(save.cpu_slot is not None for save in saves):
            if self.copy_streams:  # the copies into these slots issued so far
                after = tuple(stream.record_event() for stream in self.copy_streams)
            else:
                torch.cuda.synchronize(self.gpu_caches[0].device)
        copied = torch.cuda.Event() if self._pin else None
        for save in saves:
            with self._lock:
                if save.key in self._pending:
                    continue
                if save.cpu_slot is not None:  # its buffer once it is copied
                    snapshot = _Snapshot(None, slot=save.cpu_slot, after=after)
                    self._slot_saves[save.cpu_slot] = snapshot
                else:
                    assert save.gpu_block is not None
                    buffer = self._lend()
                    if buffer is None:
                        self.num_skipped += 1
                        continue
                    snapshot = _Snapshot(buffer, copied, pooled=True)
                self._pending[save.key] = snapshot
            if snapshot.buffer is not None:
                # behind the step in flight on the compute stream, before this step's copies
                # and compute (issued after this) may write into the block
                assert save.gpu_block is not None
                self._copy_into(
                    snapshot.buffer, self.gpu_caches, save.gpu_block, non_blocking=self._pin
                )
            self.num_saved += 1
            self._writes.put((save.key, snapshot))
        if copied is not None:
            copied.record()

    def before_overwrite(self, slots: Collection[int]) -> None:
        """These CPU slots are about to be written by this step's copies: the chunks saved from
        them and not yet copied are copied now."""
        with self._lock:
            taken = [self._slot_saves[slot] for slot in slots if slot in self._slot_saves]
        for snapshot in taken:
            self._take(snapshot, on_step=True)

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
        waits: list[tuple[bytes, _Snapshot]] = []
        with self._lock:
            for key in keys:
                staged = self._staged.get(key)
                pending = self._pending.get(key)
                if staged is not None:
                    found[key] = staged[0]
                elif pending is not None:  # copied out: the writer gives its buffer back
                    waits.append((key, pending))
                else:
                    todo.append((key, self._buffer()))
        for key, snapshot in waits:  # copied, once its bytes are there
            self._take(snapshot)
            if snapshot.copied is not None:
                snapshot.copied.synchronize()
            with snapshot.lock:  # not given back meanwhile: the writer's `_retire` waits
                if snapshot.buffer is None:  # written (or given up) since: from disk
                    todo.append((key, self._buffer()))
                    continue
                buffer = self._buffer()
                with torch.inference_mode():
                    buffer.copy_(snapshot.buffer)
            found[key] = buffer
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
                        buffer = self._buffer()
                        self._copy_into(buffer, caches, index)
                        self._queue(key, _Snapshot(buffer))
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
            for _, snapshot in batch:
                self._retire(snapshot)
            for _ in batch:
                self._writes.task_done()

    def _write(self, batch: list[_Save]) -> None:
        """Write what fits in free slots (the scheduler removed chunks to make room first)."""
        chunks = [(key, snap) for key, snap in batch if key not in self.tier]
        if not chunks or not self.tier.writable:
            return
        filled = [(key, self._bytes(snap)) for key, snap in chunks]
        written = self.tier.write([(key, _pieces(buf)) for key, buf in filled if buf is not None])
        with self._lock:
            self.num_written += len(written)

    # ---- buffers ---------------------------------------------------------------------------

    def _buffer(self) -> torch.Tensor:
        geometry = self.tier.geometry
        # [num_layers, layer_bytes]: a chunk's bytes as a slot holds them
        return host_blocks((geometry.num_layers, geometry.layer_bytes), torch.uint8, self._pin)

    def _lend(self) -> torch.Tensor | None:
        """A snapshot buffer (under `_lock`), None if every one is waiting for the disk."""
        if self._pin:
            return self._pool.pop() if self._pool else None
        if self._lent >= self._pool_size:
            return None
        self._lent += 1
        return self._buffer()

    def _copy_into(
        self,
        buffer: torch.Tensor,
        caches: Sequence[torch.Tensor],
        index: int,
        non_blocking: bool = False,
    ) -> None:
        # one call for every layer: the GIL is let go and taken back once, not once a layer
        # (with the writer's and the I/O threads about, each taking back can wait its turn)
        sources = [cache[index].view(torch.uint8).view(-1) for cache in caches]
        with torch.inference_mode():  # on any thread: the engine's tensors are inference ones
            torch._foreach_copy_(list(buffer.unbind(0)), sources, non_blocking=non_blocking)

    def _take(self, snapshot: _Snapshot, on_step: bool = False) -> None:
        """Copy a saved CPU slot into its snapshot, if no thread has yet (any thread; one
        copying it holds the others, the engine's too, until it is done), into a buffer of the
        pool; with none free, a new one off the step's path (`on_step`: the save is given up)."""
        with snapshot.lock:
            slot = snapshot.slot
            if slot is None:
                return
            with self._lock:
                buffer = self._lend()
            snapshot.pooled = buffer is not None
            if buffer is None and not on_step:
                buffer = self._buffer()
            if buffer is not None:
                for event in snapshot.after:
                    event.synchronize()
                self._copy_into(buffer, self.cpu_caches, slot)
            else:
                self.num_skipped += 1
            snapshot.buffer, snapshot.slot = buffer, None
        with self._lock:
            if self._slot_saves.get(slot) is snapshot:
                del self._slot_saves[slot]

    def _bytes(self, snapshot: _Snapshot) -> torch.Tensor | None:
        """The snapshot's buffer, once filled (the writer's, before it gives it back); None if
        the save was given up."""
        self._take(snapshot)
        if snapshot.copied is not None:
            snapshot.copied.synchronize()
        return snapshot.buffer

    def _retire(self, snapshot: _Snapshot) -> None:
        """A snapshot the writer is done with: its slot is no longer held, and its buffer goes
        back to the pool once no copy into it is in flight."""
        if snapshot.copied is not None:
            snapshot.copied.synchronize()
        with snapshot.lock:
            slot, snapshot.slot = snapshot.slot, None
            buffer, snapshot.buffer = snapshot.buffer, None
        with self._lock:
            if slot is not None and self._slot_saves.get(slot) is snapshot:
                del self._slot_saves[slot]
            if snapshot.pooled and buffer is not None:
                if self._pin:
                    self._pool.append(buffer)
                else:
                    self._lent -= 1


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
