"""A store write that waits for the replicated turn log (no I/O here: the shell appends).

With many engines, every write the store takes for a conversation goes first to the
conversation's log on JetStream (see `store/turn_log.py`), and to the store only once the log's
replicas have it: a reply is acknowledged only once its turn would survive this engine. An
append the log refuses (another engine adopted the conversation meanwhile) leaves the store as
it was, and the turn fails.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# appends a conversation's log entry to the replicated turn log; the future settles once the
# log's replicas have it, and fails if another engine holds the log
Replicate = Callable[[str, bytes], Future[Any]]


def after_replicated(
    replicate: Replicate | None,
    conv_id: str,
    entry: Callable[[], bytes],
    write: Callable[[], Future[Any]],
) -> Future[Any]:
    """`write()` (a store write), once `replicate` (if any) has the conversation's log entry
    `entry()`; the future settles with the write, or fails with the append (the store is then
    not written)."""
    if replicate is None:
        return write()
    settled: Future[Any] = Future()

    def then_write(appended: Future[Any]) -> None:
        error = appended.exception()
        if error is not None:
            settled.set_exception(error)
            return
        try:
            written = write()
        except Exception as refused:  # the writer is closed
            settled.set_exception(refused)
            return
        written.add_done_callback(lambda done: _copy(done, settled))

    replicate(conv_id, entry()).add_done_callback(then_write)
    return settled


def _copy(source: Future[Any], target: Future[Any]) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
