"""The message bus: the only module that imports `nats`.

Handlers get an `Incoming` message and answer on its reply subject. Each message is handled in a
task of its own, so a long turn never holds up the next request on the same subject; a handler
that raises is answered with an `internal` error and logged, and the subscription keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from pensieve.actors.schemas import ApiError

logger = logging.getLogger(__name__)

ERROR_HEADER = "Pensieve-Error"  # set to the error code on every error reply


@dataclass
class Incoming:
    data: bytes
    reply: str
    headers: dict[str, str]  # W3C trace context rides here ("traceparent")
    _client: Client

    async def send(self, body: bytes, error: str | None = None) -> None:
        """Publish one message to the requester's inbox (nothing if it gave none)."""
        if self.reply:
            headers = {ERROR_HEADER: error} if error else None
            await self._client.publish(self.reply, body, headers=headers)

    async def send_error(self, error: ApiError) -> None:
        await self.send(error.body(), error.code)

    async def forward(self, subject: str) -> None:
        """Hand the request on to `subject` as it came: the answer goes to the requester."""
        await self._client.publish(
            subject, self.data, reply=self.reply, headers=self.headers or None
        )


Handler = Callable[[Incoming], Awaitable[None]]


class Bus:
    def __init__(self, client: Client) -> None:
        self.client = client
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, url: str, name: str = "pensieve") -> Bus:
        """Connect, retrying until the server answers (in a compose stack the engine may start
        before NATS does); each failed try is one log line."""

        async def on_error(error: Exception) -> None:
            logger.warning("NATS at %s: %s: %s", url, type(error).__name__, error)

        client = await nats.connect(url, name=name, max_reconnect_attempts=-1, error_cb=on_error)
        return cls(client)

    async def serve(self, subject: str, handler: Handler, queue: str = "pensieve") -> None:
        """Answer requests on `subject` (members of one queue group share them)."""

        async def on_message(msg: Msg) -> None:
            task = asyncio.create_task(self._handle(handler, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        await self.client.subscribe(subject, queue=queue, cb=on_message)

    async def _handle(self, handler: Handler, msg: Msg) -> None:
        incoming = Incoming(msg.data, msg.reply, dict(msg.headers or {}), self.client)
        try:
            await handler(incoming)
        except ApiError as error:
            await incoming.send_error(error)
        except Exception as error:  # a bug must not take the subscription down
            logger.exception("handler for %s failed", msg.subject)
            await incoming.send_error(ApiError("internal", f"{type(error).__name__}: {error}"))

    async def close(self) -> None:
        """Stop handling requests and leave the bus: drain (let queued messages and replies go
        out) when connected; when NATS is down, just close, as there is nothing to drain to."""
        for task in list(self._tasks):
            task.cancel()
        if self.client.is_connected:
            try:
                await self.client.drain()
                return
            except nats.errors.Error as error:  # NATS went away while draining
                logger.warning("NATS drain failed: %s", error)
        await self.client.close()
