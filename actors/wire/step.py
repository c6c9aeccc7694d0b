"""The step protocol between the scheduler and an executor: what one step computes (`StepPlan`:
its pieces, sampling parameters and swap orders), and what the engine asks of whatever runs it
(`StepRunner`, `Launch`), whether the model is in this thread or an executor actor over the bus.
Plain data only: the engine core reads this without importing torch."""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from pensieve.actors.config import DEFAULTS
from pensieve.actors.wire.structured import Grammar

# request id -> the traceparent of its turn's span (None: not traced); see
# `actors/executor/step_tracing.py`
TraceContexts = Callable[[str], str | None]
# conversation ids -> for each, (the traceparent of its turn in flight, of its last turn's
# span): "" where it has none; see `CopyTrace`
ConversationTraces = Callable[[Collection[str]], dict[str, tuple[str, str]]]


PLACEHOLDER = -1  # a position whose token an unfinished step is sampling (see `Request.inflight`)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULTS.max_tokens
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest are cut
    # OpenAI's: subtracted from the logit of a token sampled before (once; per time sampled)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # vLLM's: `eos_ids` (the end-of-sequence and stop tokens, set by the engine) are not sampled
    # while fewer than `min_tokens` output tokens are out
    min_tokens: int = 0
    eos_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None  # what the reply must match (`actors/wire/structured.py`)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def penalized(self) -> bool:
        """Whether its logits depend on the tokens it sampled before (its output so far)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class CopyOp:
    gpu_block: int
    cpu_slot: int


@dataclass(frozen=True)
class DiskSave:
    """The chunk sealed under content `key` leaves the tiers from CPU slot `cpu_slot`, or from
    GPU block `gpu_block` (one of the two is set): the executor keeps its bytes for the disk
    tier before this step's copies reuse the slot or the block."""

    cpu_slot: int | None
    key: bytes
    gpu_block: int | None = None

    def __post_init__(self) -> None:
        if (self.cpu_slot is None) == (self.gpu_block is None):
            raise ValueError("a DiskSave names a CPU slot or a GPU block")


@dataclass(frozen=True)
class DiskLoad:
    """The chunk of content `key`, read from the disk tier when its turn arrived (`DiskReads`),
    goes into GPU block `gpu_block` in place of being recomputed."""

    key: bytes
    gpu_block: int


@dataclass
class SwapOrders:
    """Copies the executor must issue for one step, in this order.

    1. `evict_first`: GPU->CPU copies whose blocks are reused within this same step.
    2. `swap_in`: CPU->GPU copies, issued layer by layer; layer i's attention waits only for them.
    3. `swap_out`: ahead-of-time / suspension GPU->CPU copies; they start only after every
       CPU->GPU copy of the step (swap-in has priority) and overlap the step's compute.
    `fence`: a block reused this step was swapped out in an earlier step; that copy must finish
    before this step writes into the block.
    With a disk tier, `disk_drop` (content keys the disk tier removes) and then `disk_save` are
    taken before all of them (this step's copies may reuse the slots and blocks it names; the
    removals make room for the saves), and `disk_load` issued after them (its blocks may be
    evicted first).
    """

    evict_first: list[CopyOp] = field(default_factory=list)
    swap_in: list[CopyOp] = field(default_factory=list)
    swap_out: list[CopyOp] = field(default_factory=list)
    fence: bool = False
    disk_drop: list[bytes] = field(default_factory=list)
    disk_save: list[DiskSave] = field(default_factory=list)
    disk_load: list[DiskLoad] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.evict_first or self.swap_in or self.swap_out)


class CopyKind(enum.Enum):
    """Which of a step's `SwapOrders` lists a copy is in."""

    EVICT_FIRST = "evict_first"
    SWAP_IN = "swap_in"
    SWAP_OUT = "swap_out"


@dataclass(frozen=True)
class CopyTrace:
    """The copies of one kind in a step that move one conversation's chunks, as the executor
    traces them once they are done: in the trace of the conversation's turn in flight
    (`parent`, a W3C traceparent), else in a trace of their own linked to its last turn
    (`link`; "" for none)."""

    kind: CopyKind
    conversation_id: str
    num_blocks: int
    parent: str = ""
    link: str = ""


@dataclass(frozen=True)
class SeqPiece:
    """Positions [start, end) of one request, computed in this step.

    Several pieces of one request may share a step and a block table (a recomputed prefix and the
    new prompt); only a piece that reaches the request's last token samples.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    end: int
    block_table: tuple[int, ...]
    sampling: SamplingParams | None  # None: no token is sampled from this piece
    sample_index: int = 0  # which output token this sample is (keys seeded generators)
    # a constrained or penalized request's output so far, when none of its tokens is being
    # sampled: the executor's grammar matcher and token counts start from it when it has none
    # for the request (`grammar.py`, `penalties.py`)
    output_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepPlan:
    pieces: tuple[SeqPiece, ...]
    orders: SwapOrders = field(default_factory=SwapOrders)
    # where the executor finds the trace of a request new to it (None: the step is not traced)
    traces: TraceContexts | None = field(default=None, compare=False)
    # whose chunks the orders move, while tracing is on (the executor traces the copies)
    copy_traces: tuple[CopyTrace, ...] = field(default=(), compare=False)
    # prefill tokens the scheduler allowed the step beside its decodes (None: no cap but the
    # step's token budget); for the engine's step stats, not sent to an executor
    prefill_cap: int | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(piece.end - piece.start for piece in self.pieces)


@dataclass
class SwapStats:
    blocks_in: int = 0
    blocks_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0


@dataclass
class DeviceTime:
    busy_s: float = 0.0  # inside steps
    idle_s: float = 0.0  # between a step and the next one it fed

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


class Launch(Protocol):
    """A step handed to an executor: its plan, and its sampled tokens once it has run."""

    @property
    def plan(self) -> StepPlan: ...

    def result(self) -> list[int]:
        """One sampled token per piece that samples, in plan order (waits for the step)."""
        ...

    def when_done(self, callback: Callable[[], None]) -> bool:
        """Call `callback` (from any thread) once `result` would not wait; False if this
        launch cannot tell, and never calls it."""
        ...


class StepRunner(Protocol):
    """What the engine asks of an executor: the model here (`ModelRunner`) or an executor actor
    over the bus (`actors.scheduler.remote_runner.RemoteRunner`); the engine cannot tell them
    apart."""

    @property
    def block_bytes(self) -> int: ...

    def launch(self, plan: StepPlan, feed: Launch | None = None) -> Launch:
        """Issue the plan's copies and forward; `feed` is the step launched just before, whose
        sampled tokens fill this plan's PLACEHOLDER positions."""
        ...

    def settle(self) -> None:
        """Wait for every copy in flight and forget the steps launched (after a failed step)."""
        ...

    def swap_stats(self, wait: bool = True) -> SwapStats: ...

    def device_time(self) -> DeviceTime:
        """Device time in steps and idle between them (see `actors/executor/device_clock.py`)."""
        ...


class DiskRead(Protocol):
    """Chunks being read from the disk tier for one turn, started when it arrived."""

    def done(self) -> bool:
        """Whether the read has finished (never waits)."""
        ...

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the read to finish; whether it has."""
        ...

    def found(self) -> frozenset[bytes]:
        """The content keys read whole and checked (once `done`): a `DiskLoad` may name them
        until `release`."""
        ...

    def release(self) -> None:
        """The turn needs the chunks read no more (idempotent)."""
        ...


class DiskReads(Protocol):
    """The executor's disk tier, as the engine asks it (`DiskCache` in the executor's process,
    `actors.scheduler.remote_disk.RemoteDisk` from another): reads started when a turn
    arrives, and the write-back of the KV tiers on a clean stop."""

    @property
    def read_seconds_per_chunk(self) -> float:
        """What reading one chunk back costs, to weigh against recomputing it."""
        ...

    @property
    def num_slots(self) -> int:
        """How many chunks the tier holds at most (its budget)."""
        ...

    @property
    def writable(self) -> bool:
        """False once a write failed (disk full, an I/O error): the tier writes no more."""
        ...

    def keys(self) -> list[bytes]:
        """The content keys of the chunks on disk now (at start: those a run before left)."""
        ...

    def read(self, keys: Collection[bytes]) -> DiskRead | None:
        """Start reading those of `keys` the tier holds; None if it holds none of them."""
        ...

    def write_back(
        self,
        drops: Collection[bytes],
        cpu: Collection[tuple[int, bytes]],
        gpu: Collection[tuple[int, bytes]],
    ) -> int:
        """Remove the chunks of `drops`, then write these chunks, (CPU slot, key) and (GPU
        block, key), to disk and wait until every write is durable (a clean stop); how many of
        them the disk tier holds then."""
        ...

    def close(self) -> None:
        """Write what is saved, and release the tier's directory."""
        ...
