"""The scheduler's end of the per-step channel (`actors/wire/step_codec.py`): to the engine,
`RemoteRunner` is one more `StepRunner`, whose model runs in an executor actor.

The channel runs one step ahead of the device: the engine sends the plan of step N+1 before it
waits for step N's tokens, and the executor launches N+1 (its decodes fed from N's tokens on the
device) before N has finished, so a message in flight never leaves the device idle.

With a disk tier in the executor, `disk` is the engine's `DiskReads` (`remote_disk.py`): it
learns the saves and removals of each plan sent, and the tier's figures from each answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

from pensieve.actors.scheduler.remote_disk import RemoteDisk
from pensieve.actors.wire import subjects
from pensieve.actors.wire.step import DeviceTime, Launch, StepPlan, SwapStats
from pensieve.actors.wire.step_codec import (
    UNKNOWN_STEP,
    ExecutorInfo,
    ExecutorLost,
    PlanEncoder,
    StepResult,
    reset_message,
)

__all__ = ["ExecutorLost", "RemoteLaunch", "RemoteRunner", "connect_executor"]

logger = logging.getLogger(__name__)


class RemoteLaunch:
    def __init__(self, step: int, plan: StepPlan, runner: RemoteRunner) -> None:
        self.step = step
        self._plan = plan
        self._runner = runner
        self.future: concurrent.futures.Future[list[int]] = concurrent.futures.Future()

    @property
    def plan(self) -> StepPlan:
        return self._plan

    def result(self) -> list[int]:
        """The step's tokens; raises ExecutorLost as soon as the executor stops answering, or
        says it never got this step or answered it already (the message was lost, as when NATS
        restarts); a long step is fine while the executor runs it."""
        suspected: str | None = None  # what the last check found
        while True:
            try:
                return self.future.result(self._runner.check_every_s)
            except concurrent.futures.TimeoutError:
                problem = self._runner.check_step(self.step)
                # a plan or an answer still on its way (a loaded host, a busy executor) looks
                # lost to one check; a lost one still looks so a check later
                if problem is not None and problem == suspected and not self.future.done():
                    raise ExecutorLost(f"step {self.step}: {problem}") from None
                suspected = problem

    def when_done(self, callback: Callable[[], None]) -> bool:
        self.future.add_done_callback(lambda _: callback())
        return True


class RemoteRunner:
    """A `StepRunner` whose model runs in an executor actor: `launch` sends the plan and returns
    at once; `result` waits for the executor's answer. `launch` and `settle` are called from
    the engine's thread, the rest runs on the event loop."""

    def __init__(
        self, bus: Any, engine_id: str, info: ExecutorInfo, check_every_s: float = 2.0
    ) -> None:
        self.bus = bus
        self.step_subject = subjects.internal(engine_id, "executor", "step")
        self.describe_subject = subjects.internal(engine_id, "executor", "describe")
        self.result_subject = subjects.internal(engine_id, "scheduler", "result")
        self.info = info
        self.check_every_s = check_every_s  # a step that takes longer asks if the executor lives
        self.encoder = PlanEncoder(info.incarnation)
        self._steps = itertools.count(1)
        self._sent_idle = False  # the last plan sent had nothing to compute or copy
        self._pending: dict[int, RemoteLaunch] = {}
        self._swaps = SwapStats()
        self._swaps_before = SwapStats()  # the executor's totals when counting began
        self._device = DeviceTime()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        self.engine_id = engine_id
        self.disk: RemoteDisk | None = None  # the executor's disk tier (None: it has none)

    async def start(self) -> None:
        """Take results; from here `launch` may be called from any thread."""
        self._loop = asyncio.get_running_loop()
        self._sender = asyncio.create_task(self._send_all())
        await self.bus.mailbox(self.result_subject, self._on_result)
        # an executor that served a scheduler before this one forgets that one's steps (and
        # lets go of its disk reads)
        self._post(reset_message())
        if self.info.disk is not None:
            self.disk = await RemoteDisk.connect(
                self.bus, self.engine_id, self.info.disk, self._post, self._outbox.join
            )

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()

    @property
    def block_bytes(self) -> int:
        return self.info.block_bytes

    def launch(self, plan: StepPlan, feed: Launch | None = None) -> RemoteLaunch:
        if feed is not None and not isinstance(feed, RemoteLaunch):
            raise TypeError("a RemoteRunner is fed only by its own launches")
        idle = _idle(plan)
        if idle and self._sent_idle:
            # nothing to send (the engine steps while a turn waits for its disk read): the
            # executor and the encoder keep what they know. The first idle plan after work
            # still goes: it tells the executor which requests left (their traces end).
            launched = RemoteLaunch(UNKNOWN_STEP, plan, self)
            launched.future.set_result([])
            return launched
        self._sent_idle = idle
        launched = RemoteLaunch(next(self._steps), plan, self)
        self._pending[launched.step] = launched
        body = self.encoder.encode(launched.step, plan, None if feed is None else feed.step)
        if self.disk is not None:
            self.disk.ordered(plan.orders)
        self._post(body)
        return launched

    def settle(self) -> None:
        self._sent_idle = False
        self.encoder.reset()
        pending, self._pending = self._pending, {}
        for launched in pending.values():
            launched.future.cancel()
        self._post(reset_message())
        self._refresh()

    def _refresh(self) -> None:
        """Learn which executor runs now (after a reset: it may be a restarted one)."""
        assert self._loop is not None, "RemoteRunner.start was not awaited"
        asked = asyncio.run_coroutine_threadsafe(
            _describe(self.bus, self.describe_subject), self._loop
        )
        try:
            self.info = asked.result(10.0)
        except (concurrent.futures.TimeoutError, ConnectionError, TimeoutError):
            return  # none yet: the next step fails, and resets again
        self.encoder.target = self.info.incarnation
        if self.disk is not None and self.info.disk is not None:
            self.disk.info = self.info.disk  # a restarted executor: its figures

    def swap_stats(self, wait: bool = True) -> SwapStats:
        """The executor's totals as of its latest answer, since `count_from_now` if called
        (`wait` has nothing to wait for here: every answered step's copies are counted once the
        executor has timed them)."""
        now, before = self._swaps, self._swaps_before
        return SwapStats(
            *(getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(SwapStats))
        )

    def count_from_now(self) -> None:
        """Count swaps from here on (a new engine around the same executor)."""
        self._swaps_before = self._swaps

    def check_step(self, step: int) -> str | None:
        """Why step `step` will never be answered, or None while the executor runs it (called
        from the engine's thread when the step takes long)."""
        assert self._loop is not None, "RemoteRunner.start was not awaited"
        asked = asyncio.run_coroutine_threadsafe(
            _describe(self.bus, self.describe_subject), self._loop
        )
        try:
            info = asked.result(5.0)
        except (concurrent.futures.TimeoutError, ConnectionError, TimeoutError, RuntimeError):
            return "the executor stopped answering"
        if info.incarnation != self.info.incarnation:
            return "the executor restarted"
        if info.last_step < step:
            return "the plan never reached the executor"
        if info.last_answered >= step:
            return "its answer never came back"
        return None

    def device_time(self) -> DeviceTime:
        return self._device

    def _post(self, body: bytes) -> None:
        assert self._loop is not None, "RemoteRunner.start was not awaited"
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, body)

    async def _send_all(self) -> None:  # one sender: the plans leave in the order made
        while True:
            body = await self._outbox.get()
            try:
                await self.bus.publish(self.step_subject, body)
            finally:
                self._outbox.task_done()

    async def _on_result(self, data: bytes, headers: dict[str, str]) -> None:
        result = StepResult.decode(data)
        self._swaps = result.swap_stats()
        if result.device:
            self._device = DeviceTime(*result.device)
        if self.disk is not None:
            self.disk.observe(result.disk)
        if result.step == UNKNOWN_STEP:  # every step in flight is suspect: the engine resets
            for suspect in list(self._pending.values()):
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled
                    suspect.future.set_exception(RuntimeError(f"executor: {result.error}"))
            return
        launched = self._pending.pop(result.step, None)
        if launched is None or launched.future.cancelled():
            return  # a step forgotten by `settle`
        if result.stale:
            launched.future.set_exception(ExecutorLost(result.error or "the executor restarted"))
        elif result.error is not None:
            launched.future.set_exception(RuntimeError(f"executor: {result.error}"))
        else:
            launched.future.set_result(result.tokens)


def _idle(plan: StepPlan) -> bool:
    """Whether the plan has nothing for the executor to compute or copy."""
    orders = plan.orders
    disk = orders.disk_drop or orders.disk_save or orders.disk_load
    return not plan.pieces and orders.is_empty() and not orders.fence and not disk


async def connect_executor(bus: Any, engine_id: str, timeout_s: float = 600.0) -> RemoteRunner:
    """A started `RemoteRunner` to engine `engine_id`'s executor: asks it what cache it holds,
    waiting up to `timeout_s` for one to start (an actor started first waits for the others)."""
    describe = subjects.internal(engine_id, "executor", "describe")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            info = await _describe(bus, describe)
            break
        except (ConnectionError, TimeoutError):
            if loop.time() > deadline:
                raise ExecutorLost(
                    f"no executor of engine {engine_id} answered in {timeout_s:.0f} s"
                ) from None
            await asyncio.sleep(0.25)
    runner = RemoteRunner(bus, engine_id, info)
    await runner.start()
    return runner


async def _describe(bus: Any, subject: str) -> ExecutorInfo:
    async with contextlib.aclosing(bus.ask(subject, b"", timeout=2.0)) as answers:
        return ExecutorInfo.decode(await anext(answers))
