"""The message bus: the only module that imports `nats`.

Handlers get an `Incoming` message and answer on its reply subject. Each message is handled in a
task of its own, so a long turn never holds up the next request on the same subject; a handler
that raises is answered with an `internal` error and logged, and the subscription keeps serving.
Every endpoint counts its requests, errors and processing time, which `advertise` reports through
the NATS service discovery protocol.

nats-py reconnects by itself when the server goes away, but closes for good when the server
ends the connection with an error (-ERR, a payload or protocol violation): then the bus connects
again with the same options and makes every subscription it had again (endpoints, mailboxes,
service discovery, probes), logging the close as an error and the recovery as info.

A server that refuses the credentials (an authorization violation) is never retried: the first
connection raises `AuthorizationRefused`, and a reconnection refused (the credentials were
revoked) closes the connection for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import nats
import nats.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.parser import AUTHORIZATION_VIOLATION

from pensieve.actors.wire import discovery
from pensieve.actors.wire.discovery import EndpointStats, ServiceInfo
from pensieve.actors.wire.incoming import (
    FORWARDED_REPLY_HEADER,
    IMPORT_REPLY_PREFIX,
    REPLY_TO_HEADER,
    Handler,
    Incoming,
    check_fits,
)
from pensieve.actors.wire.schemas import ApiError

logger = logging.getLogger(__name__)

DISCONNECTS = "$SYS.ACCOUNT.*.DISCONNECT"  # the system account's event of a closed connection
CLOSED_CHECK_S = 1.0  # an answer waited on looks this often whether its connection closed


class AuthorizationRefused(PermissionError):
    """The NATS server refused these credentials: trying again cannot help."""


def _is_refusal(error: Exception) -> bool:
    # nats-py raises a plain Error for a refused CONNECT, AuthorizationError for a later -ERR
    refused = AUTHORIZATION_VIOLATION in str(error).lower()
    return refused or isinstance(error, nats.errors.AuthorizationError)


@dataclass(frozen=True)
class ConnectOptions:
    """Who this process is to the NATS server, in nats-py's terms (`ops/nats_auth.py` builds it
    from flags and the environment); the defaults connect anonymously."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkeys_seed: str | None = None  # the path of a seed file
    nkeys_seed_str: str | None = field(default=None, repr=False)  # or the seed itself
    user_credentials: str | None = None  # the path of a .creds file
    tls: ssl.SSLContext | None = None
    inbox_prefix: str = "_INBOX"  # a tenant may subscribe only below its own

    def who(self) -> str:
        """Who connects, for a message (no secret in it)."""
        if self.user is not None:
            return f"user {self.user!r}"
        for what, given in (
            ("a token", self.token),
            ("an nkey", self.nkeys_seed or self.nkeys_seed_str),
            ("the creds file " + str(self.user_credentials), self.user_credentials),
        ):
            if given:
                return what
        return "a connection without credentials"


@dataclass
class _Standing:
    """A subscription the bus keeps: made again on a new connection (see `Bus._recover`)."""

    subject: str
    cb: Callable[[Msg], Awaitable[None]]
    queue: str = ""
    pending_msgs_limit: int = 512 * 1024  # nats-py's default
    subscription: Subscription | None = None

    async def make(self, client: Client) -> None:
        self.subscription = await client.subscribe(
            self.subject, queue=self.queue, cb=self.cb, pending_msgs_limit=self.pending_msgs_limit
        )


Connector = Callable[[], Awaitable[Client]]


class Asked:
    """One request's answer, its messages queued as they come: `next` waits for one (a wait
    cancelled loses nothing: the messages stay queued), `take` gives one already here without
    waiting. Raises TimeoutError after `timeout` s without a message, ConnectionError if
    nothing answers on the subject or the connection closes.

    The reply subscription hands each message to a callback that queues it, so a streamed
    answer of many messages costs no task and no timer per message, where nats-py's
    `next_msg` makes both for each."""

    def __init__(self, client: Client, subject: str, timeout: float) -> None:
        self.client = client
        self.subject = subject
        self.timeout = timeout
        self._queue: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sub: Subscription | None = None

    async def send(self, body: bytes, headers: dict[str, str] | None) -> None:
        client = self.client
        check_fits(client, self.subject, body, headers)
        inbox = client.new_inbox()
        try:
            self._sub = await client.subscribe(inbox, cb=self._queued)
            await client.publish(self.subject, body, reply=inbox, headers=headers)
        except nats.errors.ConnectionClosedError:
            closed = f"{self.subject} not asked: the NATS connection is closed"
            raise ConnectionError(closed) from None

    async def _queued(self, msg: Msg) -> None:
        self._queue.append(msg)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> bytes | None:
        """The next message if one is here (None: none yet)."""
        if not self._queue:
            return None
        msg = self._queue.popleft()
        if not msg.data and (msg.headers or {}).get("Status") == "503":
            raise ConnectionError(f"nothing answers on {self.subject}")
        return msg.data

    async def next(self) -> bytes:
        """The next message, once it comes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while not self._queue:
            if self.client.is_closed:
                raise ConnectionError(f"the NATS connection closed while asking {self.subject}")
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no answer on {self.subject} in {self.timeout} s")
            self._waiter = loop.create_future()
            try:
                await asyncio.wait_for(self._waiter, min(left, CLOSED_CHECK_S))
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiter = None
        data = self.take()
        assert data is not None
        return data

    async def close(self) -> None:
        """Unsubscribe (on a connection going away its subscriptions go with it)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            closing = (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError)
            with contextlib.suppress(*closing):
                await sub.unsubscribe()


class Bus:
    def __init__(self, client: Client, reconnect: Connector | None = None, who: str = "") -> None:
        self.client = client
        self._reconnect = reconnect  # a new connection with the same options (None: no recovery)
        self._who = who  # the connection's name and server, for the log
        self._tasks: set[asyncio.Task[None]] = set()  # requests in hand
        self._endpoints: list[_Standing] = []  # what `stop_serving` ends
        self._others: list[_Standing] = []  # discovery, probes, events: until `close`
        self._recovery: asyncio.Task[None] | None = None
        self.endpoints: dict[str, EndpointStats] = {}  # by subject
        self.closing = False  # `close` was called: the connection's end is expected
        self.num_recoveries = 0  # connections made again after the server closed one
        self.refused: AuthorizationRefused | None = None  # the server refused these credentials

    @classmethod
    async def connect(
        cls, url: str, name: str = "pensieve", options: ConnectOptions | None = None
    ) -> Bus:
        """Connect as `options` says (anonymously without), retrying until the server answers
        (in a compose stack the engine may start before NATS does); each failed try is one log
        line. A connection the server closes is made again (see the module's docstring).
        Raises AuthorizationRefused at once if the server refuses the credentials."""
        made: list[Bus] = []

        async def on_closed() -> None:  # for good: nats-py reconnects only before this
            if made:
                made[0]._on_closed()

        given = options or ConnectOptions()

        async def connect() -> Client:
            client = Client()
            connected = False
            closing: list[asyncio.Task[None]] = []  # held: a task nobody holds may vanish

            async def on_error(error: Exception) -> None:
                if not _is_refusal(error):
                    logger.warning("NATS at %s: %s: %s", url, type(error).__name__, error)
                    return
                refusal = AuthorizationRefused(
                    f"the NATS server at {url} refused {given.who()}: authorization violation"
                )
                if not connected:
                    raise refusal  # out of nats-py's connect loop, which would try forever
                if made:  # a reconnection refused: the connection ends, and stays ended
                    made[0].refused = refusal
                logger.error("%s; the connection is closed", refusal)
                closing.append(asyncio.get_running_loop().create_task(client.close()))

            try:
                await client.connect(
                    url,
                    name=name,
                    max_reconnect_attempts=-1,
                    error_cb=on_error,
                    closed_cb=on_closed,
                    user=given.user,
                    password=given.password,
                    token=given.token,
                    nkeys_seed=given.nkeys_seed,
                    nkeys_seed_str=given.nkeys_seed_str,
                    user_credentials=given.user_credentials,
                    tls=given.tls,
                    inbox_prefix=given.inbox_prefix,
                )
            except AuthorizationRefused:
                await client.close()
                raise
            connected = True
            return client

        made.append(cls(await connect(), connect, f"{name!r} to {url}"))
        return made[0]

    def _on_closed(self) -> None:
        """The connection closed for good: expected after `close`, otherwise made again."""
        if self.closing or self._reconnect is None:
            return
        if self.refused is not None:
            logger.error("the NATS connection %s stays closed: %s", self._who, self.refused)
            return
        if self._recovery is not None and not self._recovery.done():
            return
        logger.error(
            "the NATS connection %s was closed (%s); connecting again",
            self._who,
            self.client.last_error or "no error given",
        )
        self._recovery = asyncio.get_running_loop().create_task(self._recover(self._reconnect))

    async def _recover(self, reconnect: Connector) -> None:
        """Connect again (nats-py retries until the server answers) and make every standing
        subscription again on the new connection."""
        try:
            client = await reconnect()
        except AuthorizationRefused as refusal:
            self.refused = refusal
            logger.error("the NATS connection %s stays closed: %s", self._who, refusal)
            return
        if self.closing:  # `close` came while connecting
            await client.close()
            return
        self.client = client
        standing = [*self._endpoints, *self._others]
        for one in standing:
            await one.make(client)
        await client.flush()
        self.num_recoveries += 1
        logger.info("the NATS connection %s is back: %d subscriptions", self._who, len(standing))

    @property
    def max_payload(self) -> int:
        """The largest message the server takes, headers included (see `check_fits`)."""
        return int(self.client.max_payload)

    async def _subscribe(self, standing: _Standing, endpoint: bool = False) -> None:
        """Subscribe, and keep the subscription across a connection made again."""
        await standing.make(self.client)
        (self._endpoints if endpoint else self._others).append(standing)

    async def serve(
        self, subject: str, handler: Handler, queue: str = "pensieve", handoff: bool = False
    ) -> None:
        """Answer requests on `subject` (members of one queue group share them). With
        `handoff`, requests come from `hand_off`: each is acknowledged as soon as it is taken,
        and the handler answers the original requester."""
        stats = EndpointStats(re.sub(r"[^A-Za-z0-9_-]", "-", subject), subject, queue)
        self.endpoints[subject] = stats

        async def on_message(msg: Msg) -> None:
            task = asyncio.create_task(self._handle(handler, msg, stats, handoff))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        await self._subscribe(_Standing(subject, on_message, queue), endpoint=True)

    async def mailbox(
        self, subject: str, handler: Callable[[bytes, dict[str, str]], Awaitable[None]]
    ) -> None:
        """Take the messages on `subject` one at a time, in the order they came (nats-py awaits
        a subscription's callback before it hands it the next message). A handler that raises
        is logged and the mailbox goes on with the next message."""

        async def on_message(msg: Msg) -> None:
            try:
                await handler(msg.data, dict(msg.headers or {}))
            except Exception:
                logger.exception("mailbox %s: a message failed", subject)

        await self._subscribe(_Standing(subject, on_message, pending_msgs_limit=1 << 20), True)

    async def on_no_responders(self, gone: Callable[[str], None]) -> str:
        """A subject prefix of this connection's own, for probes: when a message sent with a
        reply subject below it (`Incoming.send(..., probe=...)`) reaches no subscriber,
        nats-server answers that reply subject with a no-responders status (503), and
        `gone(subject)` is called. This holds within one account only: a reply to a tenant
        crosses accounts through the tenant's import, which takes it whether or not the tenant
        still listens (see `on_disconnects` for those)."""
        prefix = self.client.new_inbox()

        async def on_status(msg: Msg) -> None:
            if not msg.data and (msg.headers or {}).get("Status") == "503":
                gone(msg.subject)

        await self._subscribe(_Standing(f"{prefix}.>", on_status))
        return prefix

    async def on_disconnects(self, gone: Callable[[str], None]) -> None:
        """Call `gone(connection)` whenever a client connection of the server closes,
        `connection` named as `requester` names it. Needs a user of the system account allowed
        to subscribe to its disconnect events."""

        async def on_event(msg: Msg) -> None:
            try:
                event = orjson.loads(msg.data)
                gone(f"{event['server']['name']}/{event['client']['id']}")
            except (orjson.JSONDecodeError, KeyError, TypeError):
                logger.warning("a disconnect event not understood: %r", msg.data[:200])

        await self._subscribe(_Standing(DISCONNECTS, on_event))

    async def publish(
        self, subject: str, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        check_fits(self.client, subject, body, headers)
        await self.client.publish(subject, body, headers=headers)

    async def stop_serving(self) -> None:
        """Take no more requests: the endpoints' subscriptions go (other engines of the queue
        group take what comes next); requests already in hand go on."""
        endpoints, self._endpoints = self._endpoints, []
        if not self.client.is_connected:  # NATS is away: the server dropped them already
            return
        for endpoint in endpoints:
            if endpoint.subscription is not None:
                await endpoint.subscription.unsubscribe()

    async def settle(self, timeout: float) -> int:
        """Wait up to `timeout` s for the requests in hand to be answered; how many are not."""
        if not self._tasks:
            return 0
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        return len(pending)

    async def asking(
        self, subject: str, body: bytes, timeout: float, headers: dict[str, str] | None = None
    ) -> Asked:
        """The client side: send one request; its answer, whose messages (a streamed answer
        has several) queue as they come (`Asked`). Close it once done, so its reply
        subscription goes at once. Raises ConnectionError if the connection is closed (until
        the bus has made it again)."""
        asked = Asked(self.client, subject, timeout)
        try:
            await asked.send(body, headers)
        except BaseException:
            await asked.close()
            raise
        return asked

    async def ask(
        self, subject: str, body: bytes, timeout: float, headers: dict[str, str] | None = None
    ) -> AsyncIterator[bytes]:
        """`asking` as a generator: each message of the answer as it comes; the caller stops
        when it has the last, and closes the generator (`contextlib.aclosing`)."""
        asked = await self.asking(subject, body, timeout, headers)
        try:
            while True:
                yield await asked.next()
        finally:
            await asked.close()

    async def hand_off(
        self,
        subject: str,
        request: Incoming,
        headers: dict[str, str],
        timeout: float,
        body: bytes | None = None,
    ) -> None:
        """Pass `request` (with `body` in place of its own, if given) to the endpoint on
        `subject` (served with `handoff`), which answers the requester directly; returns once
        that endpoint has taken it. What it answers never passes through here, so the
        requester keeps its answer if this process goes away. Raises ConnectionError if
        nothing serves `subject`, TimeoutError if it does not take the request within `timeout`
        s."""
        headers = {**headers, REPLY_TO_HEADER: request.reply}
        data = request.data if body is None else body
        check_fits(self.client, subject, data, headers)
        try:
            await self.client.request(subject, data, timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError:
            raise ConnectionError(f"nothing answers on {subject}") from None
        except nats.errors.ConnectionClosedError:
            raise ConnectionError(f"{subject} not reached: the NATS connection is closed") from None
        except nats.errors.TimeoutError:
            raise TimeoutError(f"{subject} did not take the request in {timeout} s") from None

    async def answers(self, subject: str, timeout: float = 1.0) -> bool:
        """Whether something answers a request on `subject` within `timeout` s."""
        try:
            await self.client.request(subject, b"", timeout=timeout)
        except (
            nats.errors.NoRespondersError,
            nats.errors.TimeoutError,
            nats.errors.ConnectionClosedError,
        ):
            return False
        return True

    async def advertise(self, service: ServiceInfo) -> None:
        """Answer the NATS service discovery protocol for `service`, with the endpoints above
        (see `actors/wire/discovery.py`)."""
        started = datetime.datetime.now(datetime.timezone.utc).isoformat()
        for kind in discovery.KINDS:

            async def answer(msg: Msg, kind: str = kind) -> None:
                body = discovery.reply(kind, service, self.endpoints.values(), started)
                await self.client.publish(msg.reply, orjson.dumps(body))

            for subject in discovery.subjects(kind, service):
                await self._subscribe(_Standing(subject, answer))

    async def _handle(
        self, handler: Handler, msg: Msg, stats: EndpointStats, handoff: bool
    ) -> None:
        headers = dict(msg.headers or {})
        reply = msg.reply
        forwarded = headers.pop(FORWARDED_REPLY_HEADER, "")
        if not reply and forwarded.startswith(IMPORT_REPLY_PREFIX):  # see `Incoming.forward`
            reply = forwarded
        if handoff:
            reply = headers.pop(REPLY_TO_HEADER, "")
            if msg.reply:  # taken: from here the requester hears from this handler
                await self.client.publish(msg.reply, b"")
        incoming = Incoming(msg.data, reply, headers, self, msg.subject)
        stats.num_requests += 1
        begin = time.perf_counter_ns()
        error: ApiError | None = None
        try:
            await handler(incoming)
        except ApiError as refused:
            error = refused
        except Exception as failure:  # a bug must not take the subscription down
            logger.exception("handler for %s failed", msg.subject)
            error = ApiError("internal", f"{type(failure).__name__}: {failure}")
        finally:
            stats.processing_time += time.perf_counter_ns() - begin
        if error is not None:
            stats.num_errors += 1
            stats.last_error = f"{error.code}: {error.message}"
            await incoming.send_error(error)

    async def flush(self) -> None:
        """Wait until the server has every subscription and message sent so far (a ping round
        trip): without it a subscription may still sit in the client's buffer, and a request
        sent meanwhile by someone else finds no responder."""
        await self.client.flush()

    async def close(self) -> None:
        """Stop handling requests and leave the bus: drain (let queued messages and replies go
        out) when connected; when NATS is down, just close, as there is nothing to drain to."""
        self.closing = True
        if self._recovery is not None:
            self._recovery.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self.client.is_connected:
            try:
                await self.client.drain()
                return
            except (nats.errors.Error, OSError) as error:  # NATS went away while draining
                logger.warning("NATS drain failed: %s", error)
        try:
            await self.client.close()
        except OSError:  # the socket may be gone with the server
            pass
        except asyncio.CancelledError:
            # closing while a reconnect is under way can end in a future nats-py cancelled itself;
            # a cancellation of this task itself still goes on
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
