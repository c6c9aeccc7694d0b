"""The replicated turn log and the leases, on NATS JetStream: the only module besides `bus.py`
that imports `nats`, and the only one that speaks JetStream.

    stream PENSIEVE_TURNS   subjects pensieve.turns.<conversation id>: each committed turn of a
                            conversation (and its creation, and each adoption) in order
    bucket pensieve-owners  <conversation id> -> the engine that holds it (compare-and-set)
    bucket pensieve-engines <engine id> -> its heartbeat; the bucket's TTL makes it a lease: a
                            key not renewed within the TTL is gone, and the engine with it

Both compare-and-sets are JetStream's own: a log entry is appended only if the subject's last
sequence is the one its writer read (`Nats-Expected-Last-Subject-Sequence`), an owner key is
written only over the revision its writer read. An engine that adopts a conversation appends a
mark at once, so an old owner that comes back cannot append behind it (`Fenced`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.api
import nats.js.errors
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.fencing import Fenced, LogUnavailable

STREAM = "PENSIEVE_TURNS"
LOG_PREFIX = "pensieve.turns"
OWNERS = "pensieve-owners"
ENGINES = "pensieve-engines"
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
MSG_ID = "Nats-Msg-Id"  # the stream takes one message per id within its duplicate window
TRIES = 8
BACKOFF_S = 0.5
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code: the subject's last sequence differs
TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class Owner:
    engine: str
    revision: int


_KEY = re.compile(r"[A-Za-z0-9_-]{1,200}")  # one subject token and a KV key, no wildcard


def check_key(key: str) -> str:
    """`key` if it names one log subject and one bucket key; ValueError otherwise (a wildcard
    in a subject would read every conversation's log)."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"{key!r} cannot name a log or a key")
    return key


def log_subject(conv_id: str) -> str:
    return f"{LOG_PREFIX}.{check_key(conv_id)}"


def cluster_size(bus: Bus) -> int:
    """How many servers the connected one knows in its cluster (itself included)."""
    urls = bus.client._server_info.get("connect_urls") or []
    return max(1, len(urls))


def _lost_race(error: Exception) -> bool:
    """Whether `error` is a lost compare-and-set (the key or the subject moved on)."""
    if isinstance(error, nats.js.errors.KeyWrongLastSequenceError):
        return True
    return isinstance(error, nats.js.errors.APIError) and error.err_code == WRONG_LAST_SEQUENCE


def _transient(error: Exception) -> bool:
    """Whether `error` says the stream did not answer (no leader yet, a server away), rather
    than that it answered no (a 4xx: a lost compare-and-set, a key not found, a bad request)."""
    if isinstance(error, nats.js.errors.APIError):
        return error.code is None or error.code == 408 or error.code >= 500
    return isinstance(error, (TimeoutError, nats.errors.Error))


async def _answered(what: str, call: Callable[[int], Awaitable[T]], tries: int) -> T:
    """`call(attempt)`'s result, trying again while the stream does not answer; LogUnavailable
    once it did not answer any of `tries` tries."""
    for attempt in range(tries):
        try:
            return await call(attempt)
        except Exception as error:
            if not _transient(error):
                raise
            if attempt == tries - 1:
                raise LogUnavailable(f"{what} did not answer: {error}") from error
        await asyncio.sleep(BACKOFF_S)
    raise AssertionError("unreachable")


class JetStream:
    """The turn log and the two buckets over `bus`'s connection (made again when the bus
    reconnects: every call asks for the connection anew). A call the stream does not answer
    within `timeout_s` is tried again, `tries` times in all, before it raises LogUnavailable."""

    def __init__(self, bus: Bus, tries: int = TRIES, timeout_s: float = TIMEOUT_S) -> None:
        self.bus = bus
        self.tries = tries
        self.timeout_s = timeout_s
        self._buckets: dict[tuple[int, str], KeyValue] = {}

    @property
    def _js(self) -> JetStreamContext:
        return self.bus.client.jetstream(timeout=self.timeout_s)

    async def _bucket(self, name: str) -> KeyValue:
        key = (id(self.bus.client), name)
        if key not in self._buckets:
            self._buckets[key] = await self._js.key_value(name)
        return self._buckets[key]

    async def ensure(self, replicas: int, lease_ttl_s: float) -> None:
        """Make the stream and the buckets if they are not there (idempotent: every engine
        calls it at start with the same settings)."""
        js = self._js
        await js.add_stream(
            name=STREAM,
            subjects=[f"{LOG_PREFIX}.>"],
            num_replicas=replicas,
            storage=nats.js.api.StorageType.FILE,
        )
        await js.create_key_value(bucket=OWNERS, history=1, replicas=replicas)
        await js.create_key_value(bucket=ENGINES, history=1, replicas=replicas, ttl=lease_ttl_s)

    # ---- the log ----------------------------------------------------------------------------

    async def append(self, conv_id: str, data: bytes, after: int, writer: str) -> int:
        """Append `data` to the conversation's log if its last sequence is `after` (0: the log
        is empty); its sequence, once the stream's replicas have it. Fenced otherwise;
        LogUnavailable if the stream did not answer any try (sent again, the same write is taken
        once, under its message id).

        A publish whose acknowledgement is lost (a server went away; the stream elects a new
        leader) is sent again under the same message id, which the stream takes once:
        `writer` names the process appending, so two writers never share an id."""
        headers = {EXPECTED_LAST: str(after), MSG_ID: f"{conv_id}.{after}.{writer}"}

        async def publish(_: int) -> int:
            try:
                ack = await self._js.publish(
                    log_subject(conv_id), data, stream=STREAM, headers=headers
                )
            except nats.js.errors.APIError as error:
                if _lost_race(error):
                    raise Fenced(f"the log of {conv_id} moved past {after}") from None
                raise
            return int(ack.seq)

        return await _answered(f"the log of {conv_id}", publish, self.tries)

    async def read(self, conv_id: str) -> list[tuple[int, bytes]]:
        """Every entry of the conversation's log, in order, with its sequence (read again from
        the start while the stream does not answer)."""
        subject = log_subject(conv_id)

        async def read_all(_: int) -> list[tuple[int, bytes]]:
            entries: list[tuple[int, bytes]] = []
            seq = 1
            while True:
                try:
                    msg = await self._js.get_msg(STREAM, seq=seq, subject=subject, next=True)
                except nats.js.errors.NotFoundError:
                    return entries
                if msg.seq is None or msg.data is None:
                    return entries
                entries.append((msg.seq, msg.data))
                seq = msg.seq + 1

        return await _answered(f"the log of {conv_id}", read_all, self.tries)

    async def forget(self, conv_id: str) -> None:
        """Remove the conversation's log and owner key."""
        await self._js.purge_stream(STREAM, subject=log_subject(conv_id))
        owners = await self._bucket(OWNERS)
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await owners.purge(conv_id)

    # ---- owners -----------------------------------------------------------------------------

    async def owner(self, conv_id: str) -> Owner | None:
        check_key(conv_id)

        async def get(_: int) -> Owner | None:
            owners = await self._bucket(OWNERS)
            try:
                entry = await owners.get(conv_id)
            except nats.js.errors.KeyNotFoundError:  # never held, released, or deleted
                return None
            if not entry.value:
                return None
            return Owner(entry.value.decode(), int(entry.revision or 0))

        return await _answered(f"the owner of {conv_id}", get, self.tries)

    async def claim(self, conv_id: str, engine: str, over: Owner | None) -> int:
        """Make `engine` the owner if the key is still as read (`over`); its new revision.
        Fenced if it is not; LogUnavailable if the bucket did not answer any try."""
        check_key(conv_id)

        async def write(attempt: int) -> int:
            owners = await self._bucket(OWNERS)
            try:
                if over is None:
                    return int(await owners.create(conv_id, engine.encode()))
                return int(await owners.update(conv_id, engine.encode(), last=over.revision))
            except nats.js.errors.APIError as error:
                if not _lost_race(error):
                    raise
            if attempt > 0:  # an earlier try may have been written, its answer lost
                now = await self.owner(conv_id)
                if now is not None and now.engine == engine:
                    return now.revision
            raise Fenced(f"{conv_id} was claimed meanwhile")

        return await _answered(f"the owner of {conv_id}", write, self.tries)

    async def release(self, conv_id: str, revision: int) -> None:
        """Let the conversation go if this engine still holds it (the key at `revision`)."""
        owners = await self._bucket(OWNERS)
        with contextlib.suppress(nats.js.errors.APIError, nats.js.errors.KeyValueError):
            await owners.delete(conv_id, last=revision)

    # ---- engine leases ----------------------------------------------------------------------

    async def renew(self, engine: str, revision: int | None) -> int:
        """Take (`revision` None) or renew the engine's lease; its new revision. Fenced if the
        lease lapsed since `revision` (the bucket's TTL removed it)."""
        engines = await self._bucket(ENGINES)
        try:
            if revision is None:
                return int(await engines.put(engine, b"1"))
            return int(await engines.update(engine, b"1", last=revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise Fenced(f"the lease of engine {engine} lapsed") from None
        except nats.js.errors.APIError as error:
            if error.err_code == WRONG_LAST_SEQUENCE:
                raise Fenced(f"the lease of engine {engine} lapsed") from None
            raise

    async def alive(self, engine: str) -> bool:
        """Whether `engine` holds a lease: it renewed it within the bucket's TTL."""

        async def get(_: int) -> bool:
            engines = await self._bucket(ENGINES)
            try:
                entry = await engines.get(engine)
            except nats.js.errors.KeyNotFoundError:
                return False
            return bool(entry.value)

        return await _answered(f"the lease of {engine}", get, self.tries)

    async def retire(self, engine: str) -> None:
        """End the engine's lease now (a drain's last step)."""
        engines = await self._bucket(ENGINES)
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await engines.purge(engine)
