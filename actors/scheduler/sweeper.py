"""The expiry sweeper: deletes conversations idle past their TTL, off the engine thread.

Each sweep lists the expired conversations from the store in a worker thread, then has the
engine thread delete them (`ChatService.expire`, the path of `conversations.delete`, so memory,
KV and store agree) and waits until the store writer has. The store's pages freed by the deletes
are reused by later writes, so a server whose conversations expire keeps a bounded store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from pensieve.actors.config import ExpiryConfig
from pensieve.actors.scheduler.engine_thread import EngineThread

logger = logging.getLogger(__name__)

BATCH = 256  # conversations one engine-thread call deletes at most: a step waits for it


class Sweeper:
    def __init__(
        self, engine: EngineThread, expiry: ExpiryConfig, clock: Callable[[], float] = time.time
    ) -> None:
        self.engine = engine
        self.expiry = expiry
        self.clock = clock

    async def sweep(self) -> int:
        """Delete every conversation idle past its TTL now; returns how many were deleted."""
        service = self.engine.service
        now = self.clock()
        num_deleted = 0
        while True:
            found = await asyncio.to_thread(service.expired, self.expiry, now, BATCH)
            if not found:
                return num_deleted
            deletes = await asyncio.wrap_future(
                self.engine.call(service.expire, found, self.expiry, now)
            )
            for deleted in deletes:
                await asyncio.wrap_future(deleted)
            num_deleted += len(deletes)
            # a short batch was the last; a busy one is seen again by the next sweep
            if len(found) < BATCH or len(deletes) < len(found):
                return num_deleted

    async def run(self) -> None:
        """Sweep every `expiry.sweep_interval_s` until cancelled; a failed sweep is logged."""
        while True:
            await asyncio.sleep(self.expiry.sweep_interval_s)
            try:
                num_deleted = await self.sweep()
            except Exception:
                logger.exception("the expiry sweep failed; trying again next time")
            else:
                if num_deleted:
                    logger.info("deleted %d expired conversations", num_deleted)


@contextlib.asynccontextmanager
async def sweeping(engine: EngineThread, expiry: ExpiryConfig) -> AsyncIterator[Sweeper]:
    """A `Sweeper` running while the context is open."""
    sweeper = Sweeper(engine, expiry)
    task = asyncio.create_task(sweeper.run(), name="pensieve-expiry-sweeper")
    try:
        yield sweeper
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
