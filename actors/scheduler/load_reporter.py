"""The engine's load reports: what it has in hand (its turns, the context they need, its free
GPU blocks) on `pensieve.v1.engine.<id>.load`, for the ingress of every engine to place new
turns by (`actors/ingress/placement.py`). A report goes out within `CHECK_EVERY_S` of a change
of its turns (one just ended must not keep new turns away), and every `LOAD_REPORT_EVERY_S`
anyway, as a heartbeat.

A report is read from the engine thread's snapshot of its stats (refreshed every 0.1 s while it
steps, and when it goes idle), so reporting never waits for a step nor adds one. It is stamped
with the snapshot's time: the engine thread also reports at once after a step that ended turns
(`ChatService.publish_load`), and a snapshot older than that report must not replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.messages import LOAD_REPORT_EVERY_S, LoadReport

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.1  # as often as the engine thread refreshes its snapshot while it steps


def load_report(engine_id: str, stats: dict[str, Any], now: float) -> LoadReport:
    """The report of an engine whose `Engine.stats` are `stats`."""
    requests, cache = stats["requests"], stats["cache"]
    gpu = cache["gpu_blocks"]
    return LoadReport(
        engine_id,
        now,
        cache["block_size"],
        requests["running"],
        requests["waiting"],
        requests["active_tokens"],
        gpu["free"] + gpu["reclaimable"],
        gpu["total"],
    )


@contextlib.asynccontextmanager
async def reporting_load(
    bus: Bus, engine_id: str, snapshot: Callable[[], tuple[float, dict[str, Any]]]
) -> AsyncIterator[None]:
    """While open: a task that publishes this engine's load reports (from `snapshot()`, the
    engine's latest stats and when they were taken, monotonic)."""
    subject = subjects.engine_load(engine_id)

    async def report() -> None:
        sent: tuple[int, int, int] | None = None
        sent_at = 0.0
        while True:
            now = time.monotonic()
            taken, stats = snapshot()
            report = load_report(engine_id, stats, time.time() - (now - taken))
            load = (report.num_running, report.num_waiting, report.num_active_tokens)
            if load != sent or now - sent_at >= LOAD_REPORT_EVERY_S:
                try:
                    await bus.publish(subject, report.encode())
                    sent, sent_at = load, now
                except Exception as error:  # NATS away: the next report goes when it is back
                    logger.debug("load report not sent: %s", error)
            await asyncio.sleep(CHECK_EVERY_S)

    task = asyncio.create_task(report(), name="pensieve-load-report")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
