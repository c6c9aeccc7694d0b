"""The per-step channel's messages and their codec (sans-I/O): step plans from the scheduler to
the GPU executor on `pensieve.internal.<engine>.executor.step`, sampled tokens back on
`...scheduler.result`.

`PlanEncoder` (scheduler side) and `PlanDecoder` (executor side) keep the same picture of what
the executor already knows, so a request new to the executor goes in full once (its sampling
parameters and block table, and the trace context of its turn with the blocks swapped in for
it, when it is traced) and a running one as a diff (the blocks its table gained). Both sides
forget a request as soon as a step leaves it out; so both caches hold exactly the requests of
the last step and never grow. Only what the executor's sampler reads of a request's sampling
parameters crosses: stopping and lengths are the scheduler's.

The plan and the result are msgspec Structs encoded as JSON arrays (`array_like`): field names
never travel, and a step of 256 decodes is a few tens of kilobytes. Each carries
`STEP_VERSION`; a receiver refuses another with `MessageError`.

With a disk tier the orders carry its removals, saves and loads, and the step channel the
release of a turn's disk read (`release_message`): behind the plan that loads its chunks, so
the executor unstages them only once that plan's copies are issued (`disk_messages.py` has the
rest of the disk tier's messages).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from pensieve.actors.wire.disk_messages import DiskInfo
from pensieve.actors.wire.messages import UNREADABLE, Message, MessageError, decode
from pensieve.actors.wire.step import (
    CopyKind,
    CopyOp,
    CopyTrace,
    DiskLoad,
    DiskSave,
    SamplingParams,
    SeqPiece,
    StepPlan,
    SwapOrders,
    SwapStats,
)
from pensieve.actors.wire.structured import Grammar

STEP_VERSION = 5  # the schema version of the plan and result arrays
UNKNOWN_STEP = 0  # the step of a result to a plan the executor could not read (steps start at 1)


class ExecutorLost(RuntimeError):
    """No answer from the executor within the step timeout."""


# ---- the wire form ---------------------------------------------------------------------------


class Sampling(msgspec.Struct, frozen=True, array_like=True):
    """The sampling parameters the executor's sampler reads (`actors/executor/sampler.py`)."""

    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    grammar: Grammar | None = None  # what a constrained reply must match
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    eos_ids: tuple[int, ...] = ()

    @staticmethod
    def of(params: SamplingParams) -> Sampling:
        return Sampling(
            params.temperature,
            params.top_p,
            params.top_k,
            params.seed,
            params.grammar,
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.logit_bias,
            params.min_tokens,
            params.eos_ids,
        )

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            eos_ids=self.eos_ids,
            seed=self.seed,
            grammar=self.grammar,
        )


class PieceDiff(msgspec.Struct, frozen=True, array_like=True):
    """A `SeqPiece` as the executor lacks it: its block table is the first `keep` blocks of
    the table the executor holds, then `added`; `sampling` is None when the executor holds the
    parameters already (or the piece does not sample)."""

    request_id: str
    start: int
    end: int
    token_ids: tuple[int, ...]
    keep: int
    added: tuple[int, ...]
    samples: bool  # a token is sampled from this piece
    sampling: Sampling | None
    sample_index: int
    output_ids: tuple[int, ...] | None = None  # `SeqPiece.output_ids`


class Save(msgspec.Struct, frozen=True, array_like=True):
    """A `DiskSave`: the chunk of content `key`, from a CPU slot or a GPU block."""

    key: bytes
    cpu_slot: int | None
    gpu_block: int | None


class Load(msgspec.Struct, frozen=True, array_like=True):
    """A `DiskLoad`: the chunk of content `key`, read from disk, into GPU block `gpu_block`."""

    key: bytes
    gpu_block: int


class Orders(msgspec.Struct, frozen=True, array_like=True):
    """`SwapOrders`, each list of copies flat: gpu block, cpu slot, gpu block, ...; a disk
    tier's removals (keys), saves and loads."""

    evict_first: list[int]
    swap_in: list[int]
    swap_out: list[int]
    fence: bool
    disk_drop: list[bytes] = []
    disk_save: list[Save] = []
    disk_load: list[Load] = []


class Copies(msgspec.Struct, frozen=True, array_like=True):
    """A `CopyTrace`: whose chunks some of the step's copies move, and the trace they go in."""

    kind: CopyKind
    conversation_id: str
    num_blocks: int
    parent: str
    link: str

    def trace(self) -> CopyTrace:
        return CopyTrace(self.kind, self.conversation_id, self.num_blocks, self.parent, self.link)


class PlanMessage(msgspec.Struct, frozen=True, array_like=True, tag="step"):
    """Step `step`, planned for the executor incarnation `to`; `feed`: the step whose sampled
    tokens fill this plan's placeholders (None: it has none). `traces`: request id ->
    traceparent, of the traced requests new to the executor; `copies`: whose chunks the
    orders move, while tracing is on."""

    v: int
    to: str
    step: int
    feed: int | None
    pieces: list[PieceDiff]
    orders: Orders
    traces: dict[str, str] = {}
    copies: list[Copies] = []


class ResetMessage(msgspec.Struct, frozen=True, array_like=True, tag="reset"):
    """Settle the copies in flight and forget every step and request (and release every
    disk read)."""

    v: int


class ReleaseMessage(msgspec.Struct, frozen=True, array_like=True, tag="release"):
    """The turns of these disk reads need their staged chunks no more."""

    v: int
    reads: list[str]


@dataclass(frozen=True)
class DiskRelease:
    """A `ReleaseMessage` as the executor takes it, in order with the steps."""

    reads: list[str]


class StepResult(msgspec.Struct, frozen=True, array_like=True, tag=STEP_VERSION):
    """The executor's answer to one step: its sampled tokens in plan order, or why it failed;
    with the swap totals of the executor so far."""

    step: int
    tokens: list[int]
    error: str | None = None
    swaps: list[float] = []  # SwapStats fields, in order
    stale: bool = False  # not run: planned for an executor that is gone (its KV with it)
    device: list[float] = []  # DeviceTime: busy_s, idle_s
    disk: list[float] = []  # the disk tier's `DiskInfo.figures` (none: no disk tier)

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @staticmethod
    def decode(data: bytes) -> StepResult:
        try:
            return _RESULTS.decode(data)
        except UNREADABLE as error:
            raise _refusal(data, "StepResult", error, 0) from None

    def swap_stats(self) -> SwapStats:
        if not self.swaps:
            return SwapStats()
        b_in, b_out, by_in, by_out, s_in, s_out = self.swaps
        return SwapStats(int(b_in), int(b_out), int(by_in), int(by_out), s_in, s_out)


def swap_fields(stats: SwapStats) -> list[float]:
    return list(dataclasses.astuple(stats))


class ExecutorInfo(Message):
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
    disk: DiskInfo | None = None  # its disk tier (None: none)

    @staticmethod
    def decode(data: bytes) -> ExecutorInfo:
        return decode(data, ExecutorInfo)


_ENCODER = msgspec.json.Encoder()
_PLANS = msgspec.json.Decoder(PlanMessage | ResetMessage | ReleaseMessage)
_RESULTS = msgspec.json.Decoder(StepResult)


def _refusal(data: bytes, kind: str, error: Exception, at: int) -> MessageError:
    """Why a message of `kind` was refused: its version (element `at`, or an object's "v"),
    when that is not this build's."""
    try:
        body = msgspec.json.decode(data)
    except UNREADABLE:
        return MessageError(f"{kind}: not JSON ({error})")
    version = None
    if isinstance(body, dict):
        version = body.get("v")
    elif isinstance(body, list) and len(body) > at:
        version = body[at]
    if version != STEP_VERSION:
        return _other_version(kind, version)
    return MessageError(f"{kind}: {error}")


def _other_version(kind: str, version: object) -> MessageError:
    return MessageError(f"{kind}: schema version {version!r}, this build reads {STEP_VERSION}")


def reset_message() -> bytes:
    """Tells the executor to settle its copies and forget every step and request."""
    return _ENCODER.encode(ResetMessage(STEP_VERSION))


def release_message(reads: list[str]) -> bytes:
    """Tells the executor that these disk reads' chunks are needed no more."""
    return _ENCODER.encode(ReleaseMessage(STEP_VERSION, reads))


# ---- the codec -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Known:
    """What the executor holds of one request: its block table and sampling parameters."""

    table: tuple[int, ...] = ()
    sampling: SamplingParams | None = None


def _kept(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """How many leading blocks of `new` the executor's `old` table has already."""
    if new == old or new[: len(old)] == old:  # most steps: the same table, or one block more
        return len(old)
    count = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        count += 1
    return count


def _orders(orders: SwapOrders) -> Orders:
    def flat(ops: list[CopyOp]) -> list[int]:
        return [value for op in ops for value in (op.gpu_block, op.cpu_slot)]

    return Orders(
        flat(orders.evict_first),
        flat(orders.swap_in),
        flat(orders.swap_out),
        orders.fence,
        orders.disk_drop,
        [Save(s.key, s.cpu_slot, s.gpu_block) for s in orders.disk_save],
        [Load(load.key, load.gpu_block) for load in orders.disk_load],
    )


def _swap_orders(orders: Orders) -> SwapOrders:
    return SwapOrders(
        _copy_ops(orders.evict_first),
        _copy_ops(orders.swap_in),
        _copy_ops(orders.swap_out),
        orders.fence,
        list(orders.disk_drop),
        [DiskSave(s.cpu_slot, s.key, s.gpu_block) for s in orders.disk_save],  # ValueError
        [DiskLoad(load.key, load.gpu_block) for load in orders.disk_load],
    )


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
        pieces: list[PieceDiff] = []
        traces: dict[str, str] = {}  # of the requests new to the executor, if traced
        for piece in plan.pieces:
            rid = piece.request_id
            held = self._known.get(rid) or known.get(rid)
            if held is None:
                held = _Known()
                context = plan.traces(rid) if plan.traces is not None else None
                if context is not None:
                    traces[rid] = context
            keep = _kept(held.table, piece.block_table)
            params, sampling = piece.sampling, None
            if params is not None and not (params is held.sampling or params == held.sampling):
                sampling = Sampling.of(params)
                held = _Known(held.table, params)
            pieces.append(
                PieceDiff(
                    rid,
                    piece.start,
                    piece.end,
                    piece.token_ids,
                    keep,
                    piece.block_table[keep:],
                    params is not None,
                    sampling,
                    piece.sample_index,
                    piece.output_ids,
                )
            )
            self._known[rid] = _Known(piece.block_table, held.sampling)
        copies = [
            Copies(c.kind, c.conversation_id, c.num_blocks, c.parent, c.link)
            for c in plan.copy_traces
        ]
        orders = _orders(plan.orders)
        message = PlanMessage(STEP_VERSION, self.target, step, feed, pieces, orders, traces, copies)
        return _ENCODER.encode(message)


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

    def decode(self, data: bytes) -> StepMessage | DiskRelease | None:
        """The step a message carries, or the disk reads it releases; None for a reset (after
        which nothing is known)."""
        try:
            message = _PLANS.decode(data)
        except UNREADABLE as error:
            self._known.clear()  # the scheduler resets after the failure this causes
            raise _refusal(data, "StepPlan", error, 1) from None
        if message.v != STEP_VERSION:
            self._known.clear()
            raise _other_version("StepPlan", message.v)
        if isinstance(message, ResetMessage):
            self._known.clear()
            return None
        if isinstance(message, ReleaseMessage):
            return DiskRelease(message.reads)
        try:
            return self._step(message)
        except ValueError as error:
            self._known.clear()
            raise MessageError(f"StepPlan: {error}") from None

    def _step(self, message: PlanMessage) -> StepMessage:
        known, self._known = self._known, {}
        pieces = []
        for diff in message.pieces:
            rid = diff.request_id
            held = self._known.get(rid) or known.get(rid) or _Known()
            if diff.keep > len(held.table):
                raise ValueError(f"{rid}: keeps {diff.keep} blocks of a table of {len(held.table)}")
            table = held.table if diff.keep == len(held.table) else held.table[: diff.keep]
            if diff.added:
                table += diff.added
            if diff.sampling is not None:
                held = _Known(held.table, diff.sampling.params())  # ValueError: out of range
            elif diff.samples and held.sampling is None:
                raise ValueError(f"{rid}: sampling parameters never sent")
            params = held.sampling if diff.samples else None
            pieces.append(
                SeqPiece(
                    rid,
                    diff.token_ids,
                    diff.start,
                    diff.end,
                    table,
                    params,
                    diff.sample_index,
                    diff.output_ids,
                )
            )
            self._known[rid] = _Known(table, held.sampling)
        swaps = _swap_orders(message.orders)
        traces: dict[str, Any] = message.traces
        copies = tuple(c.trace() for c in message.copies)
        plan = StepPlan(tuple(pieces), swaps, traces.get, copies)
        return StepMessage(message.to, message.step, message.feed, plan)
