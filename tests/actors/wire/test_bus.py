"""The bus's client side against a real nats-server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import aclosing

import nats
import pytest

from pensieve.actors.wire.bus import AuthorizationRefused, Bus, ConnectOptions, ServiceInfo
from pensieve.actors.wire.incoming import Incoming
from pensieve.actors.wire.schemas import ApiError
from pensieve.ops.nats_accounts import add_tenant, rotate_tenant
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


def test_a_streamed_answer_comes_whole_and_in_order_however_it_is_read() -> None:
    """The messages of one answer queue as they come: taken without waiting, waited for, or
    waited for by a reader that is cancelled meanwhile, none is lost or reordered. Silence
    past the timeout is TimeoutError; a subject nobody serves, ConnectionError; a connection
    closed while a reader waits, ConnectionError within a second or so."""
    count = 500

    async def go(url: str) -> None:
        responder = await nats.connect(url)

        async def answer(msg) -> None:  # type: ignore[no-untyped-def]
            for number in range(count):
                await responder.publish(msg.reply, str(number).encode())

        await responder.subscribe("t.many", cb=answer)
        await responder.flush()
        bus = await Bus.connect(url)
        asked = await bus.asking("t.many", b"", timeout=5.0)
        got: list[bytes] = []
        while len(got) < count:
            if len(got) % 7 == 0:  # a reader cancelled while it waits loses nothing
                waiting = asyncio.ensure_future(asked.next())
                await asyncio.sleep(0)
                if waiting.cancel():
                    with pytest.raises(asyncio.CancelledError):
                        await waiting
                else:
                    got.append(waiting.result())
            got.append(await asked.next())
            while (data := asked.take()) is not None:
                got.append(data)
        assert got == [str(number).encode() for number in range(count)]
        assert asked.take() is None
        await asked.close()

        inboxes: list[str] = []

        async def silence(msg) -> None:  # type: ignore[no-untyped-def]
            inboxes.append(msg.reply)

        async def heard(count: int) -> None:  # the responder has `count` requests in hand
            deadline = asyncio.get_running_loop().time() + 10.0
            while len(inboxes) < count:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)

        # a responder of its own: the one above stays busy with its 500 answers at the server
        silent_responder = await nats.connect(url)
        await silent_responder.subscribe("t.silent", cb=silence)
        await silent_responder.flush()
        quiet = await bus.asking("t.silent", b"", timeout=0.3)
        with pytest.raises(TimeoutError):
            await quiet.next()
        await quiet.close()
        nobody = await bus.asking("t.nobody", b"", timeout=5.0)
        with pytest.raises(ConnectionError, match="nothing answers"):
            await nobody.next()
        await nobody.close()
        late = await bus.asking("t.silent", b"", timeout=30.0)
        waiting = asyncio.ensure_future(late.next())
        await heard(2)
        await asyncio.sleep(0.1)
        assert waiting.cancel()  # it waits: nothing came
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await silent_responder.publish(inboxes[-1], b"late")
        assert await late.next() == b"late"
        await late.close()
        silent = await bus.asking("t.silent", b"", timeout=30.0)
        closing = asyncio.get_running_loop().call_later(0.2, asyncio.ensure_future, bus.close())
        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionError, match="closed"):
            await silent.next()
        assert asyncio.get_running_loop().time() - started < 5.0
        closing.cancel()
        await silent.close()
        await responder.close()
        await silent_responder.close()

    with EmbeddedNats() as server:
        asyncio.run(go(server.url))


async def _close_by_the_server(bus: Bus) -> None:
    """Make nats-server end the bus's connection with an error: a message whose payload fits
    the limit but whose headers take it over (nats-py counts the payload alone, the server both:
    it answers -ERR 'Maximum Payload Violation', after which nats-py closes for good)."""
    client = bus.client
    body = b"x" * (client.max_payload - 16)
    await client.publish("t.nowhere", body, headers={"Pad": "y" * 64})
    for _ in range(200):
        if client.is_closed:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server did not close the connection")


def test_a_connection_the_server_closes_is_made_again_with_every_subscription(caplog) -> None:
    async def go(url: str) -> None:
        bus = await Bus.connect(url, name="pensieve-test")

        async def echo(msg: Incoming) -> None:
            await msg.send(b"echo:" + msg.data)

        seen: list[bytes] = []

        async def note(data: bytes, headers: dict[str, str]) -> None:
            seen.append(data)

        await bus.serve("t.echo", echo)
        await bus.mailbox("t.mail", note)
        await bus.advertise(ServiceInfo("pensieve-test", "i1", "0", "a test service"))
        await bus.flush()
        client = await nats.connect(url)
        assert (await client.request("t.echo", b"1", timeout=5)).data == b"echo:1"

        closed = bus.client
        await _close_by_the_server(bus)
        for _ in range(250):  # made again
            if bus.client is not closed and bus.client.is_connected:
                break
            await asyncio.sleep(0.02)
        assert (await client.request("t.echo", b"2", timeout=5)).data == b"echo:2"
        assert bus.num_recoveries == 1
        await client.publish("t.mail", b"m")
        ping = await client.request("$SRV.PING.pensieve-test", b"", timeout=5)
        assert b'"id": "i1"' in ping.data or b'"id":"i1"' in ping.data
        # an answer asked of the bus itself goes out on the new connection
        async with aclosing(bus.ask("t.echo", b"3", timeout=5.0)) as answer:
            assert await anext(answer) == b"echo:3"
        await client.flush()
        for _ in range(250):  # delivered, once
            if seen:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert seen == [b"m"]
        await bus.close()
        await asyncio.sleep(0.1)
        assert bus.num_recoveries == 1  # its own close is not made again
        await client.close()

    caplog.set_level(logging.INFO, logger="pensieve.actors.wire.bus")
    with EmbeddedNats() as server:
        asyncio.run(go(server.url))
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert any(level == logging.ERROR and "was closed" in text for level, text in said), said
    assert any(level == logging.INFO and "is back" in text for level, text in said), said


def test_a_message_that_would_pass_the_payload_limit_is_refused_before_it_is_sent() -> None:
    """Headers count, even none: nats-py sends an empty dict of them as 12 bytes."""

    async def go(url: str) -> None:
        bus = await Bus.connect(url)
        limit = bus.max_payload
        for headers, size in (({}, limit - 12), ({"K": "v"}, limit - 18), (None, limit)):
            with pytest.raises(ApiError) as refused:
                await bus.publish("t.big", b"x" * (size + 1), headers)
            assert refused.value.code == "too_long"
            await bus.publish("t.big", b"x" * size, headers)  # fits exactly
        await bus.flush()
        assert bus.client.is_connected and bus.num_recoveries == 0
        await bus.close()

    with EmbeddedNats() as server:
        asyncio.run(go(server.url))


def test_credentials_refused_are_never_tried_again(tmp_path, caplog) -> None:
    """A first connection the server refuses raises at once (nats-py would try forever); a
    reconnection refused, once the credentials are revoked, closes the bus for good."""

    async def go(url: str) -> None:
        with pytest.raises(AuthorizationRefused, match="without credentials"):
            await asyncio.wait_for(Bus.connect(url), 10)
        alice = add_tenant(tmp_path, "alice")
        as_alice = ConnectOptions(
            user=alice["user"], password=alice["password"], inbox_prefix=alice["inbox_prefix"]
        )
        wrong = dataclasses.replace(as_alice, password="wrong")
        with pytest.raises(AuthorizationRefused, match="user 'tenant-alice'"):
            await asyncio.wait_for(Bus.connect(url, options=wrong), 10)
        bus = await Bus.connect(url, options=as_alice)
        first = bus.client
        await asyncio.to_thread(rotate_tenant, tmp_path, "alice")  # closes its connections
        for _ in range(250):
            if bus.refused is not None and bus.client.is_closed:
                break
            await asyncio.sleep(0.02)
        assert bus.refused is not None and bus.client is first and first.is_closed
        await asyncio.sleep(2.5)  # nats-py's wait between tries: none comes
        assert bus.client is first and bus.num_recoveries == 0
        await bus.close()

    caplog.set_level(logging.INFO, logger="pensieve.actors.wire.bus")
    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        asyncio.run(go(server.url))
    said = [r.getMessage() for r in caplog.records]
    assert any("stays closed" in text or "connection is closed" in text for text in said), said
