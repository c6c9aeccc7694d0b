"""Which conversations this engine holds, through its lease and the replicated turn log.

An engine holds a lease (a key of the `pensieve-engines` bucket, renewed every quarter of its
TTL) and, for each conversation it serves, the conversation's key in `pensieve-owners`
(see `actors/wire/jetstream.py`). Before a turn (or a read, or a delete) of a conversation it
does not hold yet, the scheduler calls `hold`:

    log empty              a conversation of this store alone (or none): served as it is
    held by a live engine  refused `unavailable` (the ingress forwards there; a race lost)
    otherwise              adopted: the owner key taken by compare-and-set, an `Adopted` mark
                           appended to the log (so the old owner's appends fail from now on),
                           the store rebuilt from the log where it differs, the copy in memory
                           and its KV dropped: the turn recomputes the history's KV

Every store write of a held conversation goes to its log first (`append`), if the log's last
entry is still the one this engine wrote or read: the log itself fences an old owner that comes
back after its lease lapsed. A lease found lapsed lets go of every conversation at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pensieve.actors.scheduler.conversations import not_found
from pensieve.actors.wire import subjects
from pensieve.actors.wire.fencing import Fenced, LogUnavailable
from pensieve.actors.wire.jetstream import JetStream, Owner
from pensieve.actors.wire.schemas import ApiError
from pensieve.store import ConversationStore, StoreWriter, turn_log

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
LEASE_TTL_S = 2.0  # an engine killed is given up this long after its last renewal, at most
RELEASE_S = 15.0  # a drain's hand-over of its conversations, NATS answering or not
ADOPT_TRIES = 3  # reads of a log that its old owner was still appending to


@dataclass
class _Held:
    seq: int  # the sequence of the log's last entry, which this engine wrote or read
    revision: int | None  # of the owner key this engine wrote (None: not yet written)


class Ownership:
    """This engine's lease and held conversations; an async context manager (the lease is taken
    on entry, and let go on exit with every conversation, for other engines to adopt)."""

    def __init__(
        self,
        js: JetStream,
        engine_id: str,
        store: ConversationStore,
        writer: StoreWriter,
        lease_ttl_s: float = LEASE_TTL_S,
        replicas: int = 1,
    ) -> None:
        self.js = js
        self.engine_id = engine_id
        self.store = store
        self.writer = writer
        self.lease_ttl_s = lease_ttl_s
        self.replicas = replicas
        self.num_adopted = 0
        self._held: dict[str, _Held] = {}
        # let go when the lease lapsed, with the log's sequence this engine last wrote: a turn
        # in flight then still commits behind it, if no other engine wrote the log since
        self._lapsed: dict[str, _Held] = {}
        self._local: set[str] = set()  # conversations of the store alone (made before the log)
        self._lease: int | None = None  # the revision of this engine's lease key
        self._renewing: asyncio.Task[None] | None = None
        self._writer_id = f"{engine_id}.{secrets.token_hex(4)}"  # this process's appends

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Make the log and buckets if need be, take the lease and keep renewing it. A cluster
        just started (or a bucket just made) answers once its replicas elect a leader: until
        then, and `timeout_s` at most, this tries again."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.js.ensure(self.replicas, self.lease_ttl_s)
                self._lease = await self.js.renew(self.engine_id, None)
                break
            except Exception as error:
                if time.monotonic() > deadline:
                    raise
                logger.info("JetStream is not ready (%s); trying again", error)
                await asyncio.sleep(0.5)
        self._renewing = asyncio.get_running_loop().create_task(self._renew())

    async def __aenter__(self) -> Ownership:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    async def release(self) -> None:
        """Stop renewing the lease, let go of every held conversation, end the lease; within
        `RELEASE_S`: what NATS has not taken by then (it is away) lapses with the lease, and
        other engines adopt it as after a crash."""
        if self._renewing is None:
            return
        await stop_task(self._renewing)
        self._renewing = None
        held, self._held = self._held, {}
        released = 0

        async def hand_over() -> None:
            nonlocal released
            for conv_id, one in held.items():
                if one.revision is not None:
                    await self.js.release(conv_id, one.revision)
                released += 1
            await self.js.retire(self.engine_id)

        try:
            await asyncio.wait_for(hand_over(), RELEASE_S)
        except Exception as error:  # noqa: BLE001 - a drain goes on without NATS
            logger.warning(
                "let go of %d of %d conversations; the rest and the lease of %s are left to "
                "lapse (%s)",
                released,
                len(held),
                self.engine_id,
                error if str(error) else type(error).__name__,
            )
            return
        logger.info("let go of %d conversations and the lease of %s", len(held), self.engine_id)

    async def hold(
        self, conv_id: str, tenant: str | None, drop: Callable[[str], Awaitable[bool]]
    ) -> None:
        """Make sure this engine holds the conversation and its store has the log's copy
        (`drop` forgets the copy in memory, on the engine thread); raises ApiError
        (`not_found` for another tenant's, `unavailable` if another engine holds it or the log
        does not answer)."""
        if subjects.owner(conv_id) is None:  # not an engine's id: no engine has it in the log
            return
        try:
            await self._hold(conv_id, tenant, drop)
        except LogUnavailable as error:
            raise ApiError("unavailable", f"{error}; retry") from None

    async def _hold(
        self, conv_id: str, tenant: str | None, drop: Callable[[str], Awaitable[bool]]
    ) -> None:
        held = self._held.get(conv_id)
        if held is not None:
            owner = await self.js.owner(conv_id)
            if owner is not None and owner.engine == self.engine_id:
                return
            self._held.pop(conv_id, None)  # adopted elsewhere meanwhile
        if conv_id in self._local:
            return
        for _ in range(ADOPT_TRIES):
            with contextlib.suppress(Fenced):
                await self._adopt(conv_id, tenant, drop)
                return
        raise ApiError("unavailable", f"conversation {conv_id!r} is moving; retry")

    async def _adopt(
        self, conv_id: str, tenant: str | None, drop: Callable[[str], Awaitable[bool]]
    ) -> None:
        read = await self.js.read(conv_id)
        if not read:
            if await asyncio.to_thread(self.store.exists, conv_id):
                self._local.add(conv_id)
            return
        entries = [turn_log.decode(data) for _, data in read]
        if turn_log.tenant_of(entries) != tenant:
            raise not_found(conv_id)
        owner = await self.js.owner(conv_id)
        revision = await self._claim(conv_id, owner)
        seq = await self.js.append(
            conv_id, turn_log.adopted(self.engine_id), read[-1][0], self._writer_id
        )
        self._held[conv_id] = _Held(seq, revision)
        self._lapsed.pop(conv_id, None)
        if await asyncio.to_thread(turn_log.in_step, self.store, conv_id, entries):
            return
        if not await drop(conv_id):
            self._held.pop(conv_id, None)
            raise ApiError("unavailable", f"conversation {conv_id!r} has a turn in progress")
        rebuilt = self.writer.submit(turn_log.rebuild, self.store, conv_id, entries)
        await asyncio.wrap_future(rebuilt)
        self.num_adopted += 1
        logger.info(
            "adopted %s (%d turns) from engine %s",
            conv_id,
            turn_log.num_turns(entries),
            owner.engine if owner else "none",
        )

    async def _claim(self, conv_id: str, owner: Owner | None) -> int:
        if owner is not None and owner.engine == self.engine_id:
            return owner.revision
        if owner is not None and await self.js.alive(owner.engine):
            raise ApiError(
                "unavailable", f"conversation {conv_id!r} is held by engine {owner.engine}; retry"
            )
        return await self.js.claim(conv_id, self.engine_id, owner)

    async def append(self, conv_id: str, entry: bytes) -> None:
        """Append a store write of the conversation to its log; Fenced if another engine
        wrote the log since this one last did (then this engine no longer holds it). One let
        go when the lease lapsed is held again if no other engine wrote the log since."""
        if conv_id in self._local or subjects.owner(conv_id) is None:
            return
        lapsed = conv_id not in self._held
        held = self._held.get(conv_id) or self._lapsed.pop(conv_id, None)
        try:
            seq = await self.js.append(conv_id, entry, held.seq if held else 0, self._writer_id)
        except Fenced:
            self._held.pop(conv_id, None)
            raise
        except LogUnavailable:  # nothing changed: a retry finds it as it was
            if lapsed and held is not None:
                self._lapsed[conv_id] = held
            raise
        if held is None:  # a new conversation: no other engine knows its id yet
            held = self._held[conv_id] = _Held(seq, None)
            try:
                held.revision = await self.js.claim(conv_id, self.engine_id, None)
            except LogUnavailable:  # the turn fails: its client never learns the id
                self._held.pop(conv_id, None)
                raise
        self._held[conv_id] = held
        held.seq = seq

    async def forget(self, conv_id: str) -> None:
        """The conversation was deleted: remove its log and owner key."""
        self._held.pop(conv_id, None)
        self._lapsed.pop(conv_id, None)
        if conv_id not in self._local:
            await self.js.forget(conv_id)
        self._local.discard(conv_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 4)
            try:
                self._lease = await self.js.renew(self.engine_id, self._lease)
            except Fenced:
                logger.warning(
                    "the lease of engine %s lapsed: letting go of %d conversations",
                    self.engine_id,
                    len(self._held),
                )
                self._lapsed.update(self._held)
                self._held.clear()
                self._lease = None
                with contextlib.suppress(Exception):
                    self._lease = await self.js.renew(self.engine_id, None)
            except Exception as error:  # NATS away: the lease may lapse; appends are fenced
                logger.warning("the lease of engine %s was not renewed: %s", self.engine_id, error)


async def stop_task(task: asyncio.Task[None]) -> None:
    """Cancel the task and wait until it ended, cancelling it again if a cancellation was lost
    (before Python 3.12, `asyncio.wait_for`, under a NATS request, returns its result when the
    request completes as it is cancelled, and the task goes on)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("the lease renewal had failed: %s", task.exception())
