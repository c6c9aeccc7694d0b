"""Event loops that tests run on threads of their own."""

from __future__ import annotations

import asyncio


def finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks still pending on `loop` and let them end, as `asyncio.run` does before it
    closes its loop: a NATS client cancels its subscriptions' tasks when it closes, and a task
    destroyed unfinished with its loop warns at garbage collection, in whichever test runs then."""
    pending = asyncio.all_tasks(loop)
    if not pending:  # gather() of nothing would look for this thread's loop, which has none
        return
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
