"""The executor's disk tier as a scheduler in another process asks it: to the engine,
`RemoteDisk` is one more `DiskReads`, whose tier (`DiskCache`) runs in the executor actor
(`actors/executor/disk_service.py`, messages in `actors/wire/disk_messages.py`).

- **Reads.** `read` asks the executor and returns at once; the read is `done` once the
  executor answers with the keys it staged (a failure or no answer: none, and the turn
  recomputes them). Only keys this side believes on disk are asked, so a turn whose history
  is not there never waits for the executor: the keys on disk when the scheduler connected,
  plus the saves and minus the removals of every step's orders since.
- **Releases** go on the step channel behind the plan that loads the chunks, in order.
- **Figures.** The read rate and whether the tier still writes come with every step's answer.
- **Write-back** (a clean stop) goes after every plan and reset posted before it, in messages
  that fit the server's payload limit, and waits until the executor has them on disk.

`read`, `keys` and `write_back` are called from the engine's thread (or another that is not
the event loop's); the engine built on the event loop takes the keys it had at connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from pensieve.actors.wire import subjects
from pensieve.actors.wire.disk_messages import (
    DiskInfo,
    KeysPage,
    ReadAnswer,
    ReadRequest,
    WriteBackAnswer,
    write_back_requests,
)
from pensieve.actors.wire.messages import MessageError
from pensieve.actors.wire.step import SwapOrders
from pensieve.actors.wire.step_codec import release_message

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 60.0  # a turn's read: long histories on a slow disk take seconds
KEYS_TIMEOUT_S = 30.0  # the index of a large tier is read in pages
WRITE_BACK_TIMEOUT_S = 600.0  # one message's chunks written and made durable
SENT_TIMEOUT_S = 30.0  # the plans and resets posted before a write-back, on their way


class RemoteRead:
    """One turn's read in the executor (`actors.wire.step.DiskRead`)."""

    def __init__(self, name: str, disk: RemoteDisk) -> None:
        self.name = name
        self._disk = disk
        self._found: frozenset[bytes] | None = None  # set once, from the event loop
        self._answered = threading.Event()
        self._released = False

    def done(self) -> bool:
        return self._found is not None

    def wait(self, timeout: float) -> bool:
        return self._answered.wait(timeout)

    def found(self) -> frozenset[bytes]:
        if self._released or self._found is None:
            return frozenset()
        return self._found

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._disk.post(release_message([self.name]))

    def answered(self, found: frozenset[bytes]) -> None:
        self._found = found
        self._answered.set()


class RemoteDisk:
    def __init__(
        self,
        bus: Any,
        engine_id: str,
        info: DiskInfo,
        keys: list[bytes],
        post: Callable[[bytes], None],
        sent: Callable[[], Awaitable[None]],
    ) -> None:
        """`post` puts a message on the step channel, `sent` waits until all posted are out."""
        self.bus = bus
        self.subject = {
            verb: subjects.internal(engine_id, "executor", f"disk_{verb}")
            for verb in ("read", "keys", "write_back")
        }
        self.info = info
        self.post = post
        self._sent = sent
        self._on_disk = set(keys)  # as far as this side knows
        self._names = (f"{secrets.token_hex(4)}-{n}" for n in itertools.count())
        self._loop = asyncio.get_running_loop()

    @staticmethod
    async def connect(
        bus: Any,
        engine_id: str,
        info: DiskInfo,
        post: Callable[[bytes], None],
        sent: Callable[[], Awaitable[None]],
    ) -> RemoteDisk:
        """The executor's disk tier, with the keys on it now."""
        subject = subjects.internal(engine_id, "executor", "disk_keys")
        keys = await _keys(bus, subject)
        return RemoteDisk(bus, engine_id, info, keys, post, sent)

    @property
    def read_seconds_per_chunk(self) -> float:
        return self.info.read_seconds_per_chunk

    @property
    def num_slots(self) -> int:
        return self.info.num_slots

    @property
    def writable(self) -> bool:
        return self.info.writable

    def observe(self, figures: list[float]) -> None:
        """A step's answer: the tier's read rate and whether it writes."""
        if len(figures) == 2:
            read_s, writable = figures
            self.info = DiskInfo(self.info.num_slots, read_s, bool(writable))

    def ordered(self, orders: SwapOrders) -> None:
        """A step's orders are on their way: its removals leave the disk, its saves go there."""
        self._on_disk.difference_update(orders.disk_drop)
        self._on_disk.update(save.key for save in orders.disk_save)

    def keys(self) -> list[bytes]:
        """Asked of the executor; on the event loop (an engine built there), those known."""
        if _on_loop(self._loop):
            return list(self._on_disk)
        asked = asyncio.run_coroutine_threadsafe(_keys(self.bus, self.subject["keys"]), self._loop)
        try:
            keys = asked.result()
        except (ConnectionError, TimeoutError, MessageError) as error:
            logger.warning("disk tier: the executor's keys unknown (%s): those known kept", error)
            return list(self._on_disk)
        self._on_disk = set(keys)
        return keys

    def read(self, keys: Collection[bytes]) -> RemoteRead | None:
        wanted = [key for key in dict.fromkeys(keys) if key in self._on_disk]
        if not wanted:
            return None
        read = RemoteRead(next(self._names), self)
        asyncio.run_coroutine_threadsafe(self._read(read, wanted), self._loop)
        return read

    async def _read(self, read: RemoteRead, keys: list[bytes]) -> None:
        found: frozenset[bytes] = frozenset()
        try:
            body = ReadRequest(read.name, keys).encode()
            answer = await _ask(self.bus, self.subject["read"], body, READ_TIMEOUT_S)
            found = frozenset(ReadAnswer.decode(answer).found)
        except Exception as error:  # noqa: BLE001 - a read is a cache fill: the turn recomputes
            logger.warning("disk tier: a read failed (%s); its chunks are recomputed", error)
        finally:
            read.answered(found)

    def write_back(
        self,
        drops: Collection[bytes],
        cpu: Collection[tuple[int, bytes]],
        gpu: Collection[tuple[int, bytes]],
    ) -> int:
        writing = self._write_back(list(drops), list(cpu), list(gpu))
        try:
            held = asyncio.run_coroutine_threadsafe(writing, self._loop).result()
        except (ConnectionError, TimeoutError, MessageError) as error:
            logger.error("disk tier: the executor did not write back (%s)", error)
            return 0
        self._on_disk.difference_update(drops)
        self._on_disk.update(key for _, key in (*cpu, *gpu))
        return held

    async def _write_back(
        self, drops: list[bytes], cpu: list[tuple[int, bytes]], gpu: list[tuple[int, bytes]]
    ) -> int:
        # the executor takes it after the steps' copies are settled (a step channel that
        # cannot send is a write-back that cannot be ordered: none)
        await asyncio.wait_for(self._sent(), SENT_TIMEOUT_S)
        held = 0
        for request in write_back_requests(drops, cpu, gpu, self.bus.max_payload):
            answer = await _ask(
                self.bus, self.subject["write_back"], request.encode(), WRITE_BACK_TIMEOUT_S
            )
            held += WriteBackAnswer.decode(answer).held
        return held

    def close(self) -> None:
        """Nothing to let go of here: the executor closes its tier when it stops."""


async def _keys(bus: Any, subject: str) -> list[bytes]:
    keys: list[bytes] = []
    async with contextlib.aclosing(bus.ask(subject, b"", timeout=KEYS_TIMEOUT_S)) as answers:
        async for data in answers:
            page = KeysPage.decode(data)
            keys += page.keys
            if not page.more:
                break
    return keys


async def _ask(bus: Any, subject: str, body: bytes, timeout: float) -> bytes:
    async with contextlib.aclosing(bus.ask(subject, body, timeout=timeout)) as answers:
        return await anext(answers)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
