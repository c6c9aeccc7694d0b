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
from dataclasses import dataclass

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
APPEND_TRIES = 8
APPEND_BACKOFF_S = 0.5
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code: the subject's last sequence differs
TIMEOUT_S = 5.0


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


class JetStream:
    """The turn log and the two buckets over `bus`'s connection (made again when the bus
    reconnects: every call asks for the connection anew)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._buckets: dict[tuple[int, str], KeyValue] = {}

    @property
    def _js(self) -> JetStreamContext:
        return self.bus.client.jetstream(timeout=TIMEOUT_S)

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
        for attempt in range(APPEND_TRIES):
            try:
                ack = await self._js.publish(
                    log_subject(conv_id), data, stream=STREAM, headers=headers
                )
            except nats.js.errors.APIError as error:
                if error.err_code == WRONG_LAST_SEQUENCE:
                    raise Fenced(f"the log of {conv_id} moved past {after}") from None
                if attempt == APPEND_TRIES - 1:
                    raise
            except (TimeoutError, nats.errors.Error) as error:
                if attempt == APPEND_TRIES - 1:
                    raise LogUnavailable(f"the log of {conv_id} did not answer: {error}") from error
            else:
                return int(ack.seq)
            await asyncio.sleep(APPEND_BACKOFF_S)
        raise AssertionError("unreachable")

    async def read(self, conv_id: str) -> list[tuple[int, bytes]]:
        """Every entry of the conversation's log, in order, with its sequence."""
        entries: list[tuple[int, bytes]] = []
        seq = 1
        subject = log_subject(conv_id)
        while True:
            try:
                msg = await self._js.get_msg(STREAM, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return entries
            if msg.seq is None or msg.data is None:
                return entries
            entries.append((msg.seq, msg.data))
            seq = msg.seq + 1

    async def forget(self, conv_id: str) -> None:
        """Remove the conversation's log and owner key."""
        await self._js.purge_stream(STREAM, subject=log_subject(conv_id))
        owners = await self._bucket(OWNERS)
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await owners.purge(conv_id)

    # ---- owners -----------------------------------------------------------------------------

    async def owner(self, conv_id: str) -> Owner | None:
        owners = await self._bucket(OWNERS)
        try:
            entry = await owners.get(check_key(conv_id))
        except nats.js.errors.KeyNotFoundError:  # never held, released, or deleted
            return None
        if not entry.value:
            return None
        return Owner(entry.value.decode(), int(entry.revision or 0))

    async def claim(self, conv_id: str, engine: str, over: Owner | None) -> int:
        """Make `engine` the owner if the key is still as read (`over`); its new revision."""
        owners = await self._bucket(OWNERS)
        check_key(conv_id)
        try:
            if over is None:
                return int(await owners.create(conv_id, engine.encode()))
            return int(await owners.update(conv_id, engine.encode(), last=over.revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise Fenced(f"{conv_id} was claimed meanwhile") from None
        except nats.js.errors.APIError as error:
            if error.err_code == WRONG_LAST_SEQUENCE:
                raise Fenced(f"{conv_id} was claimed meanwhile") from None
            raise

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
        engines = await self._bucket(ENGINES)
        try:
            entry = await engines.get(engine)
        except nats.js.errors.KeyNotFoundError:
            return False
        return bool(entry.value)

    async def retire(self, engine: str) -> None:
        """End the engine's lease now (a drain's last step)."""
        engines = await self._bucket(ENGINES)
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await engines.purge(engine)
