"""What a client may hold of the HTTP ingress (`actors/ingress/http_limits.py`), against the real
actor on a real nats-server and raw sockets: slow clients are cut off after the read timeout,
connections over the cap are refused at once, and neither stops an innocent request; what
clients do wrong is a line of log, never a traceback. No engine runs: the requests that show
it need none."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from pensieve.actors.ingress.http_actor import HttpConfig, HttpIngressActor
from pensieve.actors.wire.bus import Bus
from pensieve.ops.nats_server import EmbeddedNats

ENGINE_ID = "0123abcd"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as server:
        yield server.url


@contextlib.asynccontextmanager
async def ingress(url: str, read_timeout_s: float, max_connections: int) -> AsyncIterator[int]:
    """The HTTP ingress on a free port of 127.0.0.1 (every API key accepted); yields the port."""
    config = HttpConfig(0, read_timeout_s=read_timeout_s, max_connections=max_connections)
    actor = HttpIngressActor(await Bus.connect(url), ENGINE_ID, config, lambda key: None)
    async with actor:
        assert actor.port is not None
        yield actor.port


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def dribble(writer: asyncio.StreamWriter, data: bytes, every_s: float = 0.2) -> None:
    """Send `data` a byte at a time (a slow-loris client), until the server closes."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(every_s)


async def until_closed(reader: asyncio.StreamReader, begin: float) -> tuple[float, bytes]:
    """Seconds from `begin` until the server closed the connection, and what it sent."""
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            got += chunk
    return time.monotonic() - begin, got


async def innocent(session: aiohttp.ClientSession, port: int) -> None:
    async with session.get(f"http://127.0.0.1:{port}/version") as response:
        assert response.status == 200 and (await response.json())["version"]


def test_slow_and_idle_connections_close_after_the_read_timeout(nats_url) -> None:
    timeout_s = 1.0
    long_header = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * 200}\r\n\r\n".encode()
    slow_body = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n".encode()

    async def go() -> None:
        async with ingress(nats_url, timeout_s, 64) as port, aiohttp.ClientSession() as session:
            begin = time.monotonic()
            header_lorises = [await connect(port) for _ in range(6)]
            body_lorises = [await connect(port) for _ in range(4)]
            idle = [await connect(port) for _ in range(2)]
            kept_alive = await connect(port)  # one request answered, then silence
            kept_alive[1].write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            sending = [dribble(w, long_header) for _, w in header_lorises]
            for _, writer in body_lorises:
                writer.write(slow_body)
                sending.append(dribble(writer, b"{" + b" " * 999))
            senders = [asyncio.ensure_future(s) for s in sending]
            everyone = [*header_lorises, *body_lorises, *idle, kept_alive]
            closing = [asyncio.ensure_future(until_closed(r, begin)) for r, _ in everyone]
            await asyncio.sleep(0.3)
            await innocent(session, port)  # answered while they hold their connections
            assert not any(c.done() for c in closing)
            ended = await asyncio.wait_for(asyncio.gather(*closing), 10)
            await asyncio.gather(*senders)
            for closed_after_s, _ in ended:
                assert timeout_s * 0.9 <= closed_after_s < timeout_s * 2 + 2.5, ended
            # a slow body is answered 408, in OpenAI's shape; a slow header gets nothing
            for _, sent in ended[6:10]:
                assert sent.startswith(b"HTTP/1.1 408") and b'"code":"timeout"' in sent, sent
            assert all(sent == b"" for _, sent in ended[:6])
            assert ended[-1][1].startswith(b"HTTP/1.1 200")
            await innocent(session, port)
            for _, writer in everyone:
                writer.close()

    asyncio.run(go())


def test_connections_over_the_cap_are_refused_at_once(nats_url) -> None:
    cap = 6

    async def go() -> None:
        async with ingress(nats_url, 30.0, cap) as port:
            # an innocent client's connection is open first; it keeps being answered
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector) as session:
                await innocent(session, port)
                held = [await connect(port) for _ in range(cap - 1)]
                await asyncio.sleep(0.1)  # the server has taken them
                begin = time.monotonic()
                over = [await connect(port) for _ in range(20)]
                for _, writer in over:
                    writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
                refused = await asyncio.wait_for(
                    asyncio.gather(*(until_closed(r, begin) for r, _ in over)), 10
                )
                for closed_after_s, sent in refused:
                    assert closed_after_s < 2.0
                    assert sent.startswith(b"HTTP/1.1 503") and b"unavailable" in sent, sent
                for _ in range(3):
                    await innocent(session, port)
                # a connection let go makes room for another
                for _, writer in held:
                    writer.close()
                    await writer.wait_closed()
                await asyncio.sleep(0.2)
            async with aiohttp.ClientSession() as fresh:
                await innocent(fresh, port)

    asyncio.run(go())


def test_clients_that_abort_or_send_bad_headers_log_a_line_and_no_traceback(
    nats_url, caplog
) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> None:
        async with ingress(nats_url, 30.0, 64) as port, aiohttp.ClientSession() as session:
            for _ in range(3):  # an upload the client gives up half way
                reader, writer = await connect(port)
                writer.write(
                    f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                    f"Content-Length: 100000\r\n\r\n{{".encode()
                    + b"x" * 5000
                )
                await writer.drain()
                await asyncio.sleep(0.2)
                writer.transport.abort()
            # a header over aiohttp's limit, without any key: refused before any handler
            reader, writer = await connect(port)
            writer.write(
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 9000}\r\n\r\n".encode()
            )
            _, sent = await until_closed(reader, time.monotonic())
            assert sent.split(b" ", 2)[1] == b"400", sent
            await asyncio.sleep(0.3)
            await innocent(session, port)

    asyncio.run(go())
    records = [r for r in caplog.records if r.name.startswith(("aiohttp", "pensieve"))]
    assert not [r for r in records if r.exc_info or r.levelno >= logging.ERROR], [
        (r.name, r.levelname, r.getMessage()) for r in records
    ]
    aborted = [r for r in records if "went away" in r.getMessage()]
    assert len(aborted) == 3 and all(r.levelno == logging.INFO for r in aborted)
    (bad,) = [r for r in records if r.levelno == logging.WARNING]
    assert "8190" in bad.getMessage() or "too long" in bad.getMessage().lower()
