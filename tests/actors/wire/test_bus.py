"""The bus's client side against a real nats-server."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import nats

from pensieve.actors.wire.bus import Bus
from pensieve.ops.nats_server import EmbeddedNats


async def _two_part_answers(url: str) -> nats.NATS:
    """A responder on `t.two` that answers every request with two messages."""
    responder = await nats.connect(url)

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        await responder.publish(msg.reply, b"one")
        await responder.publish(msg.reply, b"two")

    await responder.subscribe("t.two", cb=answer)
    await responder.flush()
    return responder


def test_a_caller_that_stops_early_leaves_no_reply_subscription() -> None:
    async def go(url: str) -> None:
        responder = await _two_part_answers(url)
        bus = await Bus.connect(url)
        before = len(bus.client._subs)  # nats-py's table of the connection's subscriptions
        async with aclosing(bus.ask("t.two", b"", timeout=5.0)) as answer:
            async for data in answer:
                assert data == b"one"
                break
        assert len(bus.client._subs) == before
        await bus.close()
        await responder.close()

    with EmbeddedNats() as server:
        asyncio.run(go(server.url))


def test_an_answer_closed_after_its_connection_raises_nothing() -> None:
    """A caller's generator may be closed only after the bus has shut down (at interpreter
    exit, say): its reply subscription went with the connection, and unsubscribing from it
    must not raise (it did: ConnectionClosedError, logged as a task exception never
    retrieved)."""

    async def go(url: str) -> None:
        responder = await _two_part_answers(url)
        bus = await Bus.connect(url)
        answer = bus.ask("t.two", b"", timeout=5.0)
        assert await anext(answer) == b"one"
        await bus.client.close()  # (a drain would wait for the unread "two")
        await answer.aclose()
        await responder.close()

    with EmbeddedNats() as server:
        asyncio.run(go(server.url))
