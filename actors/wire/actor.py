"""An actor's async shell: its own NATS connection, its endpoints and mailboxes, and its own
identity in the NATS service protocol.

The core an actor wraps is a plain class (CPU-testable, no I/O); the shell subscribes, decodes,
calls the core and publishes. Two ways in:

- an endpoint (`Bus.serve`) answers requests, each in a task of its own, so a slow one never
  holds up the next (the ingress's turns, the tokenizer's renders);
- a mailbox (`Actor.mailbox`) takes messages one at a time in arrival order (the executor's step
  plans, whose order is their meaning).

Every actor answers `$SRV.PING|INFO|STATS.pensieve-<actor>` with its endpoints, so
`nats micro list` shows each actor of each engine as a service of its own.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import ClassVar

from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.discovery import ServiceInfo
from pensieve.actors.wire.incoming import Handler
from pensieve.actors.wire.version import version

logger = logging.getLogger(__name__)

Mail = Callable[[bytes, dict[str, str]], Awaitable[None]]


class Actor:
    """Subclasses name themselves (`name`, one of `subjects.ACTORS`) and subscribe in `setup`."""

    name: ClassVar[str]
    description: ClassVar[str]

    def __init__(self, bus: Bus, engine_id: str) -> None:
        self.bus = bus
        self.engine_id = engine_id
        # one service instance per actor process or replica
        self.instance_id = f"{engine_id}-{secrets.token_hex(3)}"
        self._started = False

    def subject(self, verb: str, actor: str | None = None) -> str:
        """An internal subject of this engine: this actor's own, or `actor`'s."""
        return subjects.internal(self.engine_id, actor or self.name, verb)

    async def setup(self) -> None:
        """Subscribe to this actor's subjects (called once by `start`)."""

    async def teardown(self) -> None:
        """Let go of what `setup` made, after the subscriptions are gone."""

    async def serve(self, verb: str, handler: Handler, queue: str | None = None) -> None:
        """Answer requests on this actor's `verb` subject; replicas of one queue share them."""
        await self.bus.serve(self.subject(verb), handler, queue=queue or self.name)

    async def mailbox(self, verb: str, handler: Mail) -> None:
        """Take messages on this actor's `verb` subject one at a time, in order."""
        await self.bus.mailbox(self.subject(verb), handler)

    async def start(self) -> None:
        """Subscribe and advertise; returns once the server has every subscription, so a
        message sent after it is taken (idempotent)."""
        if self._started:
            return
        self._started = True
        await self.setup()
        info = ServiceInfo(
            subjects.actor_service(self.name), self.instance_id, version(), self.description
        )
        await self.bus.advertise(info)
        await self.bus.flush()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Take nothing new, give what is in hand `grace_s` to finish, leave the bus."""
        if not self._started:
            return
        self._started = False
        await self.bus.stop_serving()
        await self.bus.settle(grace_s)
        try:
            await self.teardown()
        except Exception:  # noqa: BLE001 - leave the bus however the teardown ends
            logger.exception("%s: its teardown failed", self.name)
        await self.bus.close()

    async def __aenter__(self) -> Actor:
        await self.start()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
