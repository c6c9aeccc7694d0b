"""What one client may hold of the HTTP ingress's server: time to send a request, connections.

- A request's headers must arrive within `read_timeout_s` of the connection opening, or of the
  response before on it, and its body within `read_timeout_s` after them (`read_body`); an idle
  kept-alive connection closes after as long. So a slow client (slow-loris: a byte every few
  seconds) holds a connection for that long at most.
- At most `max_connections` are open at once (`CappedSite`): one more is answered 503 at once
  and closed, before the server reads a byte of it.
- aiohttp's own log of a request it refuses before any handler sees it (a malformed or
  oversized header) is one warning line, and a client gone one info line (`ServerLog`): what a
  client sends is no server error.

aiohttp has the pieces (its keep-alive timer closes a connection whose request has not arrived
when it fires; `handler_cancellation` ends a handler whose client went away) but no timeout of
its own on a body or a cap on connections; `server_options` and `CappedSite` put them together.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pensieve.actors.ingress.openai_api import OpenAIError

# after an error answered before the body was read (413, 408), what comes of the body is read
# and dropped this long, so the client reads the error instead of a reset connection
LINGER_S = 1.0
REFUSAL_LINGER_S = 1.0  # how long a refused connection gets to read its 503


def server_options(read_timeout_s: float) -> dict[str, Any]:
    """The options of aiohttp's server (`web.AppRunner`) that bound what a client holds."""
    return {
        # armed when a connection opens and after each response: a request whose headers
        # have not all arrived when it fires closes the connection, as does an idle one
        "keepalive_timeout": read_timeout_s,
        "lingering_time": LINGER_S,
        "handler_cancellation": True,  # a client gone ends its handler (and so its turn)
        "logger": ServerLog(logging.getLogger("aiohttp.server"), {}),
    }


async def read_body(request: web.Request, read_timeout_s: float) -> bytes:
    """The request's body, which must arrive within the read timeout; 408 if it does not (the
    connection then closes, as the rest of the body is not awaited)."""
    try:
        async with asyncio.timeout(read_timeout_s):
            return await request.read()
    except TimeoutError:
        raise OpenAIError(
            408,
            f"the request body did not arrive within {read_timeout_s:g} s",
            "invalid_request_error",
            "timeout",
        ) from None


class CappedSite(web.BaseSite):
    """aiohttp's TCP site, taking at most `max_connections` at once: each one more is answered
    503 and closed, at once, while those already open go on."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int) -> None:
        super().__init__(runner)
        self.host = host
        self.requested_port = port
        self.max_connections = max_connections

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.requested_port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # the runner is set up before a site is made

        loop = asyncio.get_running_loop()
        # connections accepted whose handler has not yet joined `server.connections`: the loop
        # may accept a burst before any of them is made. The decrement is queued before the
        # transport queues its `connection_made`, and nothing runs between the two.
        accepted = 0

        def made() -> None:
            nonlocal accepted
            accepted -= 1

        def protocol() -> asyncio.BaseProtocol:
            nonlocal accepted
            if len(server.connections) + accepted >= self.max_connections:
                return _Refusal()
            accepted += 1
            loop.call_soon(made)
            return server()

        self._server = await loop.create_server(
            protocol, self.host, self.requested_port, backlog=self._backlog
        )


_REFUSED = orjson.dumps(
    OpenAIError(
        503, "too many connections; retry in a moment", "server_error", "unavailable"
    ).body()
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s"
) % (len(_REFUSED), _REFUSED)


class _Refusal(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed; what it sends is dropped (reading it
    keeps the close clean, so the client sees the answer), for REFUSAL_LINGER_S at most."""

    def __init__(self) -> None:
        self._abort: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(REFUSAL)
        if transport.can_write_eof():
            transport.write_eof()
        loop = asyncio.get_running_loop()
        self._abort = loop.call_later(REFUSAL_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the client has read the answer and closed: so does the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._abort is not None:
            self._abort.cancel()


class ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log, where a request refused as malformed (a bad request line, a header
    too long) is a warning of one line, and a client gone an info line; anything else, a
    failure of the server, keeps its traceback."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if isinstance(error, HttpProcessingError):
            kwargs["exc_info"] = None
            reason = error.message or type(error).__name__
            super().log(min(level, logging.WARNING), f"{msg}: %s", *args, reason, **kwargs)
        elif isinstance(error, ConnectionError | asyncio.CancelledError):
            kwargs["exc_info"] = None
            super().log(min(level, logging.INFO), f"{msg}: the client went away", *args, **kwargs)
        else:
            super().log(level, msg, *args, **kwargs)
