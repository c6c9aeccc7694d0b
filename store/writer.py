"""A background thread that applies store writes in submission order.

The engine's step loop must never wait on an LMDB commit (each one syncs to disk), so it hands its
writes to a `StoreWriter` and carries on:

    with StoreWriter() as writer:
        future = writer.submit(store.commit_turn, conv_id, record, keep_len, tokens)
        ...
        await asyncio.wrap_future(future)  # only where the caller needs the write to be durable
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future[Any]


class StoreWriter:
    """One thread, one FIFO queue: writes are applied one at a time, in the order submitted.

    A write that raises is logged and its exception is set on its Future; the writer keeps
    running. `close()` applies everything already submitted, then stops the thread; it is
    idempotent, and `submit` after it raises RuntimeError.
    """

    def __init__(self, name: str = "pensieve-store-writer") -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Queue `fn(*args)`; the Future resolves to its result once it has been applied."""
        future: Future[_T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("store writer is closed")
            self._queue.put(_Job(fn, args, future))
        return future

    def flush(self) -> None:
        """Wait until every write submitted before this call has been applied.

        Must not be called from inside a submitted write (it would wait for itself).
        """
        self.submit(_nothing).result()

    def close(self) -> None:
        """Drain the queue, then stop the thread. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                result = job.fn(*job.args)
            except BaseException as exc:
                logger.exception("store write %s failed", getattr(job.fn, "__qualname__", job.fn))
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)


def _nothing() -> None:
    return None
