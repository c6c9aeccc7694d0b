"""StoreWriter: ordered background writes into a real ConversationStore."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from pensieve.store import ConversationStore, StoreWriter, TurnRecord


def turn(index: int) -> TurnRecord:
    return TurnRecord(index, "u", "a", 1, 1, (index,), "stop", 0, 0, 0, 1.0, 2.0)


def test_writes_apply_in_submission_order(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "db") as store, StoreWriter() as writer:
        # The store refuses a turn out of order, so any reordering would fail a future.
        futures = [writer.submit(store.commit_turn, "c", turn(i), i, [i]) for i in range(50)]
        writer.flush()
        assert all(f.done() and f.exception() is None for f in futures)
        assert futures[-1].result().num_turns == 50
        assert store.token_log("c") == list(range(50))


def test_submit_does_not_wait_for_the_write() -> None:
    release = threading.Event()
    with StoreWriter() as writer:
        start = time.perf_counter()
        blocked = writer.submit(release.wait, 5.0)
        after = writer.submit(lambda: "after")
        assert time.perf_counter() - start < 4.0  # not the 5 s the first write waits
        assert not blocked.done() and not after.done()
        release.set()
        assert after.result(timeout=5) == "after"


def test_failed_write_surfaces_and_writer_keeps_going(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ConversationStore(tmp_path / "db") as store, StoreWriter() as writer:
        first = writer.submit(store.commit_turn, "c", turn(0), 0, [1])
        bad = writer.submit(store.commit_turn, "c", turn(5), 1, [2])
        with caplog.at_level(logging.ERROR, logger="pensieve.store.writer"):
            second = writer.submit(store.commit_turn, "c", turn(1), 1, [3])
            second.result(timeout=5)
        assert first.result().num_turns == 1
        assert isinstance(bad.exception(), ValueError)
        assert "cannot commit turn 5" in str(bad.exception())
        assert "store write" in caplog.text and "commit_turn" in caplog.text
        assert store.token_log("c") == [1, 3]


def test_close_drains_then_refuses(tmp_path: Path) -> None:
    done: list[int] = []
    writer = StoreWriter()

    def slow_append(i: int) -> None:
        time.sleep(0.001)
        done.append(i)

    for i in range(20):
        writer.submit(slow_append, i)
    writer.close()
    assert done == list(range(20))
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(done.append, 99)


def test_cancelled_write_is_skipped() -> None:
    release = threading.Event()
    ran: list[str] = []
    with StoreWriter() as writer:
        writer.submit(release.wait, 5.0)
        cancelled = writer.submit(ran.append, "cancelled")
        assert cancelled.cancel()
        release.set()
        writer.submit(ran.append, "kept").result(timeout=5)
    assert ran == ["kept"]
