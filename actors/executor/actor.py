"""The GPU executor actor: runs the step plans the scheduler sends and answers their tokens.

It hosts the model and, in the same process, the swap manager (`SwapEngine`: the GPU and CPU
pools and the copy streams share the device's memory and events with the forward). Plans come
through a mailbox, in order, and go to one worker thread that launches them on the device; a
second thread waits for each launch's tokens and sends them back, so the worker can launch step
N+1 (fed from step N's tokens on the device) while step N still runs.

While tracing is on, the runner traces each request's phases here (`step_tracing.py`),
under the trace context its plan brings. Given the store, the swap manager keeps the CPU tier's
spill index in it (`SpillKeeper`), following the engine's KV events on a writer thread of its own.

Under tensor parallelism each GPU's rank is an executor actor of its own process, all of one
incarnation: every rank takes every plan from the `step` mailbox (the plans are the same for
all: the block tables and swap orders index each rank's share of every block) and runs it, its
collectives meeting the other ranks'; the first rank alone answers, describes the executor and
keeps the spill index, for all of them.

Subjects (`pensieve.internal.<engine>.executor.*`): `step` (plans, resets and disk read
releases, a mailbox), `describe` (what cache this executor holds, asked by the scheduler when
it starts); with a disk tier, `disk_read`, `disk_keys` and `disk_write_back`
(`disk_service.py`); and the engine's KV events, `pensieve.v1.engine.<id>.kv` (a mailbox),
with the store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pensieve.actors.executor.disk_service import DiskService
from pensieve.actors.executor.kernel_profile import StepProfile
from pensieve.actors.executor.model_runner import Launched, ModelRunner
from pensieve.actors.executor.spill_keeper import SpillKeeper
from pensieve.actors.wire import subjects
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.disk_messages import WriteBackRequest
from pensieve.actors.wire.incoming import Incoming
from pensieve.actors.wire.messages import MessageError, decode_kv_events
from pensieve.actors.wire.step_codec import (
    UNKNOWN_STEP,
    DiskRelease,
    ExecutorInfo,
    PlanDecoder,
    StepMessage,
    StepResult,
    swap_fields,
)
from pensieve.store import ConversationStore, StoreWriter

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass
class _InOrder:
    """Work for the worker thread, after the plans taken before it."""

    work: Callable[[], Any]
    done: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)

    def run(self) -> None:
        try:
            self.done.set_result(self.work())
        except Exception as error:  # answered to whoever asked
            self.done.set_exception(error)


class ExecutorActor(Actor):
    name = "executor"
    description = "runs the scheduler's step plans on the model and samples (and the swaps)"

    def __init__(
        self,
        bus: Any,
        engine_id: str,
        runner: ModelRunner,
        cpu_threads: int | None = None,
        store: ConversationStore | None = None,
        incarnation: str | None = None,
    ) -> None:
        super().__init__(bus, engine_id)
        self.runner = runner
        self.cpu_threads = cpu_threads
        # the first rank (or the only one) speaks for the executor; the others only run plans
        self.answers = runner.shard is None or runner.shard.rank == 0
        # where the spill index goes (None: kept by no one here)
        self.store = store if self.answers else None
        self.spills: SpillKeeper | None = None
        self._spill_writer: StoreWriter | None = None
        self.decoder = PlanDecoder()
        # the disk tier, for a scheduler in another process (None: none, or not this rank's say)
        disk = runner.disk if self.answers else None
        self.disk = None if disk is None else DiskService(disk, bus)
        # this start of the executor (of all its ranks, which share it): its KV
        self.incarnation = incarnation or secrets.token_hex(6)
        self.last_step = 0  # the last step plan taken, since the last reset
        self.last_answered = 0  # the last step whose answer went out
        self._plans: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._launched: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        rank = 0 if runner.shard is None else runner.shard.rank
        self.profile = StepProfile.from_env(rank, runner.device.type == "cuda")

    def info(self) -> ExecutorInfo:
        cache = self.runner.cache
        return ExecutorInfo(
            self.incarnation,
            self.runner.block_bytes,
            cache.block_size,
            cache.num_gpu_blocks,
            cache.num_cpu_blocks,
            self.last_step,
            self.last_answered,
            None if self.disk is None else self.disk.info(),
        )

    async def setup(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._threads = [
            threading.Thread(target=self._run, name="pensieve-executor", daemon=True),
            threading.Thread(target=self._report, name="pensieve-executor-results", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        if self.store is not None:  # this start's CPU tier is empty, and so is its index
            self._spill_writer = StoreWriter("pensieve-spill-index")
            self.spills = SpillKeeper(self.store, self._spill_writer)
            await self.bus.mailbox(subjects.kv_events(self.engine_id), self._on_kv_events)
        await self.mailbox("step", self._on_step)
        if self.answers:
            await self.serve("describe", self._describe)
        if self.disk is not None:
            await self.serve("disk_read", self.disk.on_read)
            await self.serve("disk_keys", self.disk.on_keys)
            await self.serve("disk_write_back", self._disk_write_back)

    async def teardown(self) -> None:
        self._plans.put(_STOP)
        for thread in self._threads:
            await asyncio.to_thread(thread.join)
        if self._spill_writer is not None:  # applies the writes still queued
            await asyncio.to_thread(self._spill_writer.close)

    async def _on_kv_events(self, data: bytes, headers: dict[str, str]) -> None:
        assert self._spill_writer is not None
        self._spill_writer.submit(self._follow_kv_events, data)  # decoded off the event loop

    def _follow_kv_events(self, data: bytes) -> None:  # on the spill writer's thread
        assert self.spills is not None
        try:
            batch = decode_kv_events(data)
        except ValueError as error:  # unreadable: the next batch shows a gap
            logger.warning("a KV event batch was not applied to the spill index: %s", error)
            return
        self.spills.apply_batch(batch)

    async def _describe(self, msg: Incoming) -> None:
        await msg.send(self.info().encode())

    async def _disk_write_back(self, msg: Incoming) -> None:
        """After the steps and the reset the scheduler sent before it (their copies settled)."""
        assert self.disk is not None
        disk, request = self.disk, WriteBackRequest.decode(msg.data)
        ordered = _InOrder(lambda: disk.write_back(request))
        self._plans.put(ordered)
        await msg.send((await asyncio.wrap_future(ordered.done)).encode())

    async def _on_step(self, data: bytes, headers: dict[str, str]) -> None:
        try:
            message = self.decoder.decode(data)
        except MessageError as error:  # answered by the worker, in order with the steps
            self._plans.put(error)
            return
        if message is None:  # a reset: the scheduler numbers its steps from here
            self.last_step = self.last_answered = 0
        elif isinstance(message, StepMessage):
            self.last_step = message.step
        self._plans.put(message)

    # ---- the worker threads ----------------------------------------------------------------

    def _run(self) -> None:
        """Launch each plan as it comes; the launches of the last two steps feed the next."""
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        self._on_device()
        recent: dict[int, Launched] = {}
        while True:
            item = self._plans.get()
            if item is _STOP:
                self._launched.put(_STOP)
                return
            if item is None:  # a reset: the scheduler forgot every step in flight
                recent.clear()
                self._guard(self.runner.settle)
                if self.disk is not None:
                    self.disk.release_all()
                continue
            if isinstance(item, DiskRelease):  # after the plan that loads the reads' chunks
                if self.disk is not None:
                    self.disk.release(item.reads)
                continue
            if isinstance(item, _InOrder):
                item.run()
                continue
            if isinstance(item, MessageError):  # which step it was is unknown: fail them all
                logger.error("a step plan could not be read: %s", item)
                self._send(
                    StepResult(UNKNOWN_STEP, [], f"a step plan could not be read: {item}").encode()
                )
                continue
            message: StepMessage = item
            if message.to != self.incarnation:  # planned on KV that another executor held
                stale = f"the step was planned for executor {message.to}, which is gone"
                self._send(StepResult(message.step, [], stale, stale=True).encode(), message.step)
                continue
            if self.profile is not None:
                self.profile.before_launch(message.step)
            begin = time.perf_counter()
            try:
                feed = None if message.feed is None else recent[message.feed]
                launched = self.runner.launch(message.plan, feed)
            except Exception as error:
                logger.exception("step %d failed", message.step)
                self._launched.put((message.step, None, f"{type(error).__name__}: {error}"))
                continue
            if self.profile is not None:
                self.profile.launched(message.step, time.perf_counter() - begin)
            self.runner.swap_stats(wait=False)  # folds in the timings of finished copies
            recent = {k: v for k, v in recent.items() if k >= message.step - 1}
            recent[message.step] = launched
            self._launched.put((message.step, launched, None))

    def _report(self) -> None:
        """Send each step's tokens once the device has them."""
        self._on_device()
        while True:
            item = self._launched.get()
            if item is _STOP:
                return
            step, launched, error = item
            tokens: list[int] = []
            begin = time.perf_counter()
            if launched is not None:
                try:
                    tokens = launched.result()
                except Exception as failure:
                    error = f"{type(failure).__name__}: {failure}"
            if self.profile is not None:
                self.profile.answered(step, time.perf_counter() - begin)
            swaps = swap_fields(self.runner.swap_totals())
            device = self.runner.device_time()  # the events it reads are on this step's stream
            busy_idle = [device.busy_s, device.idle_s]
            disk = [] if self.disk is None else self.disk.figures()
            result = StepResult(step, tokens, error, swaps, device=busy_idle, disk=disk)
            self._send(result.encode(), step)

    def _on_device(self) -> None:
        # a thread starts on GPU 0: a rank of another GPU would put its streams, events and
        # graphs there
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)

    def _send(self, body: bytes, step: int = 0) -> None:
        assert self._loop is not None
        self.last_answered = max(self.last_answered, step)
        if not self.answers:
            return
        subject = self.subject("result", "scheduler")
        asyncio.run_coroutine_threadsafe(self.bus.publish(subject, body), self._loop)

    @staticmethod
    def _guard(fn: Any) -> None:
        try:
            fn()
        except Exception:
            logger.exception("executor reset failed")
