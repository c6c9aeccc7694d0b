"""The data that crosses from the scheduler to the executor for one step (plain data only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pensieve.actors.scheduler.kv.kv_cache import SwapOrders
from pensieve.actors.scheduler.request import SamplingParams

RequestTrace = tuple[str, int]  # a request's traceparent, and the blocks swapped in for it
# request id -> its trace (None: not traced); see `actors/executor/step_tracing.py`
TraceContexts = Callable[[str], RequestTrace | None]


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


@dataclass(frozen=True)
class StepPlan:
    pieces: tuple[SeqPiece, ...]
    orders: SwapOrders = field(default_factory=SwapOrders)
    # where the executor finds the trace of a request new to it (None: the step is not traced)
    traces: TraceContexts | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(piece.end - piece.start for piece in self.pieces)
