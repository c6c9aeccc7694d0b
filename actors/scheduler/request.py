"""A request: one turn of one conversation, tracked as computed positions vs target positions."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pensieve.actors.wire.chunk_keys import Namespace
from pensieve.actors.wire.step import PLACEHOLDER, DiskRead, SamplingParams


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # rejected or failed; `Request.error` says why
    CANCELLED = "cancelled"  # its requester cancelled it, or its timeout passed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenSources:
    """Where the prompt positions of a turn came from."""

    gpu: int = 0
    cpu: int = 0
    recomputed: int = 0
    new: int = 0
    # of `gpu` and `cpu`: found by content in chunks another conversation computed
    shared: int = 0
    disk: int = 0  # read back from the disk tier

    def __add__(self, other: TokenSources) -> TokenSources:
        return TokenSources(
            self.gpu + other.gpu,
            self.cpu + other.cpu,
            self.recomputed + other.recomputed,
            self.new + other.new,
            self.shared + other.shared,
            self.disk + other.disk,
        )


@dataclass
class Request:
    request_id: str
    conv_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: float
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    pending: list[tuple[int, int]] = field(default_factory=list)  # positions still to compute
    # tokens sampled by steps whose results are not applied yet: they count as positions (the
    # next step may already feed them, straight from the device) but not as output
    inflight: int = 0
    # pieces of it in planned steps not applied yet: a suspended turn is readmitted only once
    # they are, so that the positions they compute are counted before its KV is cut again
    unapplied: int = 0
    sources: TokenSources = TokenSources()
    num_suspensions: int = 0
    # blocks of its conversation copied CPU -> GPU for it, and GPU -> CPU while it ran (when
    # suspended); the ahead-of-time swap-outs after it ends belong to no turn
    swapped_in_blocks: int = 0
    swapped_out_blocks: int = 0
    finish_reason: FinishReason | None = None
    # its history's chunks being read from the disk tier since it arrived (None: none)
    disk_read: DiskRead | None = None
    error: str | None = None
    admitted_at: float | None = None  # when the scheduler first admitted it (queued until then)
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # between its output tokens (ITL)
    finish_time: float | None = None
    # the block table of its conversation while running: pinned chunks never move, so it only
    # grows by the blocks of new chunks (rebuilt on admission)
    block_table: tuple[int, ...] = ()
    # the recompute planner's ranges for its history, asked when it arrived (None: no plan);
    # admission decides, and counts whether the plan foresaw what it recomputed
    planned_recompute: tuple[tuple[int, int], ...] | None = None
    # a stop string completes with output token number `stop_at`: the turn ends there, and
    # tokens sampled after it (while the text was being found) are discarded
    stop_at: int | None = None
    # how its prompt's chunks are keyed (`chunk_keys.Namespace`; None: as the cache's)
    cache_namespace: Namespace | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """`tuple(all_ids[start:end])` without joining the whole prompt and output; a position
        still being sampled reads PLACEHOLDER."""
        known = len(self.prompt_ids) + len(self.output_ids)
        if end > known:
            return (*self.token_slice(start, known), *[PLACEHOLDER] * (end - max(start, known)))
        split = len(self.prompt_ids)
        if end <= split:
            return tuple(self.prompt_ids[start:end])
        if start >= split:
            return tuple(self.output_ids[start - split : end - split])
        return (*self.prompt_ids[start:], *self.output_ids[: end - split])

    @property
    def num_tokens(self) -> int:
        """Positions of the turn so far, the in-flight ones included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight

    def expect_sample(self, max_model_len: int) -> None:
        """A step that samples the next token was planned: its position exists from now on, and
        is pending unless that token ends the turn by length whatever its value."""
        self.inflight += 1
        count = len(self.output_ids) + self.inflight
        if count < self.sampling.max_tokens and self.num_tokens < max_model_len:
            self.pending.append((self.num_tokens - 1, self.num_tokens))

    @property
    def first_pending(self) -> int:
        return self.pending[0][0] if self.pending else self.num_tokens

    def peek_end(self, budget: int) -> int:
        """The position after the last one `take(budget)` would return."""
        end = self.first_pending
        for start, stop in self.pending:
            if budget <= 0:
                break
            end = min(stop, start + budget)
            budget -= end - start
        return end

    def take(self, budget: int) -> list[tuple[int, int]]:
        """Pop up to `budget` positions off the pending ranges, in order."""
        taken: list[tuple[int, int]] = []
        while self.pending and budget > 0:
            start, end = self.pending[0]
            stop = min(end, start + budget)
            taken.append((start, stop))
            budget -= stop - start
            if stop == end:
                self.pending.pop(0)
            else:
                self.pending[0] = (stop, end)
        return taken

    def finish_check(self, max_model_len: int) -> FinishReason | None:
        """Whether the last applied token ends the turn (`expect_sample` predicted the lengths)."""
        last = self.output_ids[-1]
        if self.stop_at is not None and len(self.output_ids) >= self.stop_at:
            return FinishReason.STOP
        if not self.sampling.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if last in self.sampling.stop_token_ids:
            return FinishReason.STOP
        applied = len(self.prompt_ids) + len(self.output_ids)
        if len(self.output_ids) >= self.sampling.max_tokens or applied >= max_model_len:
            return FinishReason.LENGTH
        return None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
