"""The per-step channel between the scheduler and the GPU executor: step plans out, sampled
tokens back, as messages on `pensieve.internal.<engine>.executor.step` and `...scheduler.result`.

The core here is sans-I/O: `PlanEncoder` (scheduler side) and `PlanDecoder` (executor side) keep
the same picture of what the executor already knows, so a request new to the executor goes in
full once (its sampling parameters and block table, and the trace context of its turn with the
blocks swapped in for it, when it is traced) and a running one as a diff (the blocks its table
gained). Both sides forget a request as soon as a step leaves it out; so both caches hold
exactly the requests of the last step and never grow. `RemoteRunner` is the scheduler's shell: to
the engine it is one more `StepRunner`.

The channel runs one step ahead of the device: the engine sends the plan of step N+1 before it
waits for step N's tokens, and the executor launches N+1 (its decodes fed from N's tokens on the
device) before N has finished, so a message in flight never leaves the device idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from pensieve.actors.executor.device_clock import DeviceTime
from pensieve.actors.executor.model_runner import Launch
from pensieve.actors.executor.swap import SwapStats
from pensieve.actors.scheduler.kv.kv_cache import CopyOp, SwapOrders
from pensieve.actors.scheduler.request import SamplingParams
from pensieve.actors.wire import subjects
from pensieve.actors.wire.messages import VERSION, MessageError, decode, decode_fields, encode
from pensieve.actors.wire.step import SeqPiece, StepPlan

logger = logging.getLogger(__name__)

_SAME = 1  # a sampling piece of a request whose parameters the executor holds already
UNKNOWN_STEP = 0  # the step of a result to a plan the executor could not read (steps start at 1)


@dataclass
class _Known:
    """What the executor holds of one request: its block table and sampling parameters."""

    table: tuple[int, ...] = ()
    sampling: SamplingParams | None = None


def _kept(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """How many leading blocks of `new` the executor's `old` table has already."""
    if new[: len(old)] == old:
        return len(old)
    count = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        count += 1
    return count


def _orders(orders: SwapOrders) -> list[Any]:
    def pairs(ops: list[CopyOp]) -> list[int]:  # flat: gpu, cpu, gpu, cpu, ...
        return [value for op in ops for value in (op.gpu_block, op.cpu_slot)]

    return [pairs(orders.evict_first), pairs(orders.swap_in), pairs(orders.swap_out), orders.fence]


def _copy_ops(flat: list[int]) -> list[CopyOp]:
    return [CopyOp(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


class PlanEncoder:
    """The scheduler's half: a step plan as one message, diffed against what the executor
    holds after the step before."""

    def __init__(self, target: str = "") -> None:
        self._known: dict[str, _Known] = {}
        self.target = target  # the executor incarnation the plans are meant for

    def reset(self) -> None:
        """Forget what the executor holds (it was told to forget it too: `reset_message`)."""
        self._known.clear()

    def encode(self, step: int, plan: StepPlan, feed: int | None) -> bytes:
        """Step number `step`; `feed`: the step whose sampled tokens fill this plan's
        placeholders (None: it has none)."""
        known, self._known = self._known, {}
        rows: list[list[Any]] = []
        traces: dict[str, list[Any]] = {}  # of the requests new to the executor, if traced
        for piece in plan.pieces:
            rid = piece.request_id
            held = self._known.get(rid) or known.get(rid)
            if held is None:
                held = _Known()
                context = plan.traces(rid) if plan.traces is not None else None
                if context is not None:
                    traces[rid] = list(context)
            keep = _kept(held.table, piece.block_table)
            sampling: Any = None
            if piece.sampling is not None:
                if piece.sampling == held.sampling:
                    sampling = _SAME
                else:
                    sampling = dataclasses.astuple(piece.sampling)
                    held = dataclasses.replace(held, sampling=piece.sampling)
            rows.append(
                [
                    piece.request_id,
                    piece.start,
                    piece.end,
                    piece.token_ids,
                    keep,
                    piece.block_table[keep:],
                    sampling,
                    piece.sample_index,
                ]
            )
            self._known[piece.request_id] = _Known(piece.block_table, held.sampling)
        body = {
            "v": VERSION,
            "kind": "step",
            "to": self.target,
            "step": step,
            "feed": feed,
            "pieces": rows,
            "orders": _orders(plan.orders),
        }
        if traces:
            body["traces"] = traces
        return orjson.dumps(body)


def reset_message() -> bytes:
    """Tells the executor to settle its copies and forget every step and request."""
    return orjson.dumps({"v": VERSION, "kind": "reset"})


@dataclass(frozen=True)
class StepMessage:
    to: str  # the executor incarnation it was planned for: the KV it assumes lives there
    step: int
    feed: int | None
    plan: StepPlan


class PlanDecoder:
    """The executor's half: messages back into step plans with whole block tables."""

    def __init__(self) -> None:
        self._known: dict[str, _Known] = {}

    def decode(self, data: bytes) -> StepMessage | None:
        """The step a message carries; None for a reset (after which nothing is known)."""
        body = decode_fields(data, "StepPlan")
        if body.get("kind") == "reset":
            self._known.clear()
            return None
        try:
            return self._step(body)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            self._known.clear()  # the scheduler resets after the failure this causes
            raise MessageError(f"StepPlan: {type(error).__name__}: {error}") from None

    def _step(self, body: dict[str, Any]) -> StepMessage:
        known, self._known = self._known, {}
        pieces = []
        for rid, start, end, tokens, keep, added, sampling, index in body["pieces"]:
            held = self._known.get(rid) or known.get(rid) or _Known()
            if keep > len(held.table):
                raise ValueError(f"{rid}: keeps {keep} blocks of a table of {len(held.table)}")
            table = (*held.table[:keep], *added)
            if isinstance(sampling, list):
                held = dataclasses.replace(held, sampling=_sampling(sampling))
            elif sampling == _SAME and held.sampling is None:
                raise ValueError(f"{rid}: sampling parameters never sent")
            params = None if sampling is None else held.sampling
            pieces.append(SeqPiece(rid, tuple(tokens), start, end, table, params, index))
            self._known[rid] = _Known(table, held.sampling)
        evict, swap_in, swap_out, fence = body["orders"]
        orders = SwapOrders(_copy_ops(evict), _copy_ops(swap_in), _copy_ops(swap_out), fence)
        traces = {
            rid: (str(parent), int(blocks))
            for rid, (parent, blocks) in body.get("traces", {}).items()
        }
        plan = StepPlan(tuple(pieces), orders, traces.get)
        return StepMessage(body["to"], body["step"], body["feed"], plan)


def _sampling(values: list[Any]) -> SamplingParams:
    *head, stop_ids, ignore_eos = values
    return SamplingParams(*head, stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)


# ---- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """The executor's answer to one step: its sampled tokens in plan order, or why it failed;
    with the swap totals of the executor so far."""

    step: int
    tokens: list[int]
    error: str | None = None
    swaps: list[float] = field(default_factory=list)  # SwapStats fields, in order
    stale: bool = False  # not run: planned for an executor that is gone (its KV with it)
    device: list[float] = field(default_factory=list)  # DeviceTime: busy_s, idle_s

    def encode(self) -> bytes:
        return encode(self)

    @staticmethod
    def decode(data: bytes) -> StepResult:
        return decode(data, StepResult)

    def swap_stats(self) -> SwapStats:
        if not self.swaps:
            return SwapStats()
        b_in, b_out, by_in, by_out, s_in, s_out = self.swaps
        return SwapStats(int(b_in), int(b_out), int(by_in), int(by_out), s_in, s_out)


def swap_fields(stats: SwapStats) -> list[float]:
    return list(dataclasses.astuple(stats))


@dataclass(frozen=True)
class ExecutorInfo:
    """What an executor tells the scheduler at start: the cache it holds, and which start of
    the executor process this is (a restarted executor holds no KV)."""

    incarnation: str
    block_bytes: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    # the last step it took and the last it answered (since its last reset): a step between
    # them is running; one past the first never reached it, one below the second was answered
    last_step: int = 0
    last_answered: int = 0

    def encode(self) -> bytes:
        return encode(self)

    @staticmethod
    def decode(data: bytes) -> ExecutorInfo:
        return decode(data, ExecutorInfo)


# ---- the scheduler's shell ------------------------------------------------------------------


class ExecutorLost(RuntimeError):
    """No answer from the executor within the step timeout."""


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
        while True:
            try:
                return self.future.result(self._runner.check_every_s)
            except concurrent.futures.TimeoutError:
                problem = self._runner.check_step(self.step)
                if problem is not None and not self.future.done():
                    raise ExecutorLost(f"step {self.step}: {problem}") from None

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
        self._pending: dict[int, RemoteLaunch] = {}
        self._swaps = SwapStats()
        self._swaps_before = SwapStats()  # the executor's totals when counting began
        self._device = DeviceTime()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Take results; from here `launch` may be called from any thread."""
        self._loop = asyncio.get_running_loop()
        self._sender = asyncio.create_task(self._send_all())
        await self.bus.mailbox(self.result_subject, self._on_result)
        # an executor that served a scheduler before this one forgets that one's steps
        self._post(reset_message())

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()

    @property
    def block_bytes(self) -> int:
        return self.info.block_bytes

    def launch(self, plan: StepPlan, feed: Launch | None = None) -> RemoteLaunch:
        if feed is not None and not isinstance(feed, RemoteLaunch):
            raise TypeError("a RemoteRunner is fed only by its own launches")
        launched = RemoteLaunch(next(self._steps), plan, self)
        self._pending[launched.step] = launched
        body = self.encoder.encode(launched.step, plan, None if feed is None else feed.step)
        self._post(body)
        return launched

    def settle(self) -> None:
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
            await self.bus.publish(self.step_subject, body)

    async def _on_result(self, data: bytes, headers: dict[str, str]) -> None:
        result = StepResult.decode(data)
        self._swaps = result.swap_stats()
        if result.device:
            self._device = DeviceTime(*result.device)
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
