"""A turn's sink between the engine thread and the event loop: deltas that pile up while the
loop is busy go out as one, in order, and never across the turn's end."""

from __future__ import annotations

import asyncio
import threading

from pensieve.actors.scheduler.engine_thread import ReplySink
from pensieve.actors.wire.schemas import ApiError


def test_deltas_queued_behind_one_are_joined_in_order_and_stop_at_the_end() -> None:
    async def go() -> None:
        sink = ReplySink(asyncio.get_running_loop())

        def engine(first: int, last: int, end: bool) -> None:
            for number in range(first, last):
                sink.delta(f"<{number}>", number + 1)
            if end:
                sink.done({"text": "whole"})

        # the loop is busy (it does not run) while the engine thread sends 40 deltas
        thread = threading.Thread(target=engine, args=(0, 40, False))
        thread.start()
        thread.join()
        await asyncio.sleep(0.05)  # the thread's calls reach the queue
        kind, (text, tokens) = await sink.next()
        assert kind == "delta"
        assert text == "".join(f"<{number}>" for number in range(40)) and tokens == 40
        # one delta alone goes as it came; then deltas behind it up to the end, and the end
        engine(40, 41, False)
        await asyncio.sleep(0.01)
        assert await sink.next() == ("delta", ("<40>", 41))
        engine(41, 45, True)
        sink.delta("<after>", 99)  # a turn's sink takes nothing after its end; this shows
        sink.error(ApiError("internal", "x"))  # that items behind the end stay apart
        await asyncio.sleep(0.01)
        assert await sink.next() == ("delta", ("<41><42><43><44>", 45))
        assert await sink.next() == ("done", {"text": "whole"})
        assert await sink.next() == ("delta", ("<after>", 99))
        kind, error = await sink.next()
        assert kind == "error" and error.code == "internal"

    asyncio.run(go())
