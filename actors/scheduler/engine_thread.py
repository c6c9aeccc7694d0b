"""The engine thread: it owns the `ChatService` (and through it the engine, the scheduler and the
cache). Every call into the service runs on this thread, between steps (or, for the tokenizer's
answers, while a step waits for the device), so none of them needs a lock. The thread steps the
engine while there is work and otherwise sleeps on its command queue. A turn's reply goes back
to the event loop that answers it through a `ReplySink`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.wire.schemas import ApiError
from pensieve.actors.wire.step import Launch
from pensieve.kernels.compile_log import process_log

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_STOP = object()
SNAPSHOT_EVERY_S = 0.1
# how long the engine thread takes answers during a step before it waits on the step itself,
# which checks that a remote executor still lives
TAKE_TEXT_FOR_S = 1.0


class ReplySink:
    """A turn's sink: forwards the engine thread's calls (`delta`, `done`, `error`) to the event
    loop that answers the turn, as queue items."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.abandoned = False  # its requester went away (on the event loop's thread)
        self._after: tuple[str, Any] | None = None  # taken while joining deltas, not yet given

    async def next(self) -> tuple[str, Any]:
        """The next item, with every delta already queued behind a delta joined into it (its
        text in order, the token count the last one's): when the event loop falls behind the
        engine, a turn sends one message for what piled up rather than one per step."""
        item, self._after = self._after, None
        if item is None:
            item = await self.items.get()
        if item[0] != "delta":
            return item
        texts, tokens = [item[1][0]], item[1][1]
        while not self.items.empty():
            after = self.items.get_nowait()
            if after[0] != "delta":
                self._after = after
                break
            texts.append(after[1][0])
            tokens = after[1][1]
        return ("delta", ("".join(texts), tokens)) if len(texts) > 1 else item

    def _put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))

    def delta(self, text: str, tokens: int) -> None:
        self._put("delta", (text, tokens))

    def done(self, reply: dict[str, Any]) -> None:
        self._put("done", reply)

    def error(self, error: ApiError) -> None:
        self._put("error", error)


class _StepDone:
    """Queued when a remote step's tokens are in: the engine thread stops taking answers."""

    def __init__(self, step: Launch) -> None:
        self.step = step


class EngineThread:
    """The thread that steps the engine and runs the API calls queued to it.

    On a CPU engine its PyTorch work runs on `cpu_threads` threads (see `ops.factory.cpu_threads`:
    one core is left to the event loop, the tokenizer thread and NATS, because PyTorch's parallel
    regions wait for their slowest thread whenever those run)."""

    def __init__(self, service: ChatService, cpu_threads: int | None = None) -> None:
        self.service = service
        self.cpu_threads = cpu_threads
        # the service's stats as of a recent step, for a stats request that finds the thread
        # busy: it never waits for a step (refreshed at most every SNAPSHOT_EVERY_S)
        self.snapshot: tuple[float, dict[str, Any]] = (time.monotonic(), service.stats())
        self.log = service.step_log
        self.log.watch_compiles(process_log().events)  # the Triton kernels this process compiles
        self.stepping = False  # in a step now: a stats request takes the snapshot
        service.metrics.follow_engine(lambda: self.snapshot[1])  # read at each scrape
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._deferred: collections.deque[Any] = collections.deque()  # taken out during a step
        self._thread = threading.Thread(target=self._run, name="pensieve-engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)` on the engine thread, between two steps."""
        future: Future[_T] = Future()
        self._commands.put((fn, args, future, False))
        return future

    def call_text(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)`, which applies a tokenizer's answer, on the engine thread: between
        two steps, or as soon as it comes while a remote step is in flight (see
        `ChatService.take_text`)."""
        future: Future[_T] = Future()
        self._commands.put((fn, args, future, True))
        return future

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)  # this thread's parallel regions
        broken: ApiError | None = None  # set when a reset failed too: no more steps
        changed = False  # since the snapshot: a step, or a command (a turn added, cancelled)
        while True:
            busy = broken is None and self.service.has_work()
            if changed and not busy:  # idle from here: the snapshot is exact until it steps
                self.snapshot, changed = (time.monotonic(), self.service.stats()), False
            try:
                command = self._deferred.popleft() if self._deferred else None
                command = command or self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            if not busy:
                self.log.idle()  # no step waited while it slept
            if isinstance(command, _StepDone):  # that wait ended already
                continue
            if command is _STOP:
                self.service.fail_all(ApiError("internal", "the server is shutting down"))
                return
            if command is not None:
                began = time.perf_counter()
                _run_command(command, broken)
                self.log.command(_name(command[0]), time.perf_counter() - began)
                changed = True
                continue  # take every queued command before the next step
            try:
                self.stepping = True
                began = time.perf_counter()
                self.service.step()
                self.log.stepped(time.perf_counter() - began, self.service.engine.last_timing)
                self.stepping = False
                changed = True
                if time.monotonic() - self.snapshot[0] > SNAPSHOT_EVERY_S:
                    began = time.perf_counter()
                    self.snapshot, changed = (time.monotonic(), self.service.stats()), False
                    self.log.snapshot(time.perf_counter() - began)
            except Exception as error:
                self.stepping = False
                logger.exception("engine step failed; resetting the engine")
                try:
                    self.service.recover(error)
                except Exception as failure:  # e.g. a device error that does not go away
                    logger.exception("the engine could not be reset; it takes no more turns")
                    broken = ApiError(
                        "internal",
                        f"the engine failed and could not be reset ({failure}); restart the server",
                    )
                    self.service.fail_all(broken)

    def take_text(self, step: Launch) -> None:
        """While `step` runs in a remote executor: apply the tokenizer's answers as they come
        (an answer only touches turns whose tokens it was asked about); keep every other
        command, in order, for after the step."""
        if not step.when_done(lambda: self._commands.put(_StepDone(step))):
            return
        while True:
            try:
                command = self._commands.get(timeout=TAKE_TEXT_FOR_S)
            except queue.Empty:
                return
            if isinstance(command, _StepDone):
                if command.step is step:
                    return
            elif command is not _STOP and command[3]:
                _run_command(command, None)
            else:
                self._deferred.append(command)
                if command is _STOP:
                    return


def _run_command(command: tuple[Any, ...], broken: ApiError | None) -> None:
    fn, args, future, _ = command
    if not future.set_running_or_notify_cancel():  # its caller went away
        return
    try:
        if broken is not None:
            raise broken
        future.set_result(fn(*args))
    except BaseException as error:  # handed to the caller, who answers with it
        future.set_exception(error)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)
