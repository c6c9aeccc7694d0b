"""OpenAI's presence and frequency penalties and logit bias, and vLLM's `min_tokens`, applied to
a step's logits before sampling (greedy rows too).

A penalized request's counts (how often it has sampled each token) live on the device, one row
of a pool per request: the tokens each step samples are added there on the device, so no step
waits for another's tokens. A request the executor holds no counts for (new to it, or left out
of a step and so forgotten, or after a restart) comes with its output so far (`SeqPiece.
output_ids`: the scheduler sends it whenever none of the request's tokens is being sampled),
and its counts are made from that.

    logits[token] += bias[token] - presence * (count[token] > 0) - frequency * count[token]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pensieve.actors.wire.step import SamplingParams, SeqPiece
from pensieve.kernels.metadata import upload


@dataclass
class _Counts:
    slot: int  # its row of the pool
    consumed: int  # how many of the request's output tokens are counted


class Penalties:
    """The counts of penalized requests (see the module); called from the executor's thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # [slots, the logits' width], made at the first penalized sample
        self._pool = torch.zeros((0, 0), dtype=torch.int32, device=device)
        self._counts: dict[str, _Counts] = {}
        self._free: list[int] = []

    @property
    def num_penalized(self) -> int:
        return len(self._counts)

    def forget_absent(self, pieces: Iterable[SeqPiece]) -> None:
        """Forget the counts of requests the step leaves out."""
        if self._counts:
            present = {piece.request_id for piece in pieces}
            for request_id in [r for r in self._counts if r not in present]:
                self._free.append(self._counts.pop(request_id).slot)

    def apply(self, logits: torch.Tensor, sampling: Sequence[SeqPiece]) -> list[int]:
        """Bias and penalize the logits [pieces that sample, V] of the pieces `sampling`, in
        place; the rows whose counts take the tokens sampled from them (`sampled`)."""
        params: list[SamplingParams] = [p.sampling for p in sampling]  # type: ignore[misc]
        self._bias(logits, params)
        self._hold_back(logits, sampling, params)
        rows = [row for row, p in enumerate(params) if p.penalized]
        if not rows:
            return rows
        if self._pool.shape[1] != logits.shape[1]:
            assert not self._counts, "the logits' width changed"
            self._pool = torch.zeros((0, logits.shape[1]), dtype=torch.int32, device=self.device)
            self._free = []
        slots = [self._ready(sampling[row]) for row in rows]
        where = upload(torch.tensor(rows, dtype=torch.long), self.device)
        counts = self._pool.index_select(0, upload(torch.tensor(slots), self.device)).float()
        weights = upload(
            torch.tensor(
                [(params[row].presence_penalty, params[row].frequency_penalty) for row in rows]
            ),
            self.device,
        )
        penalty = weights[:, :1] * (counts > 0) + weights[:, 1:] * counts
        penalized = logits.index_select(0, where) - penalty
        logits.index_copy_(0, where, penalized.to(logits.dtype))
        return rows

    def sampled(self, tokens: torch.Tensor, sampling: Sequence[SeqPiece], rows: list[int]) -> None:
        """`tokens` [pieces that sample] were drawn for `sampling`: the `rows` (of `apply`)
        count theirs."""
        if not rows:
            return
        states = [self._counts[sampling[row].request_id] for row in rows]
        slots = upload(torch.tensor([s.slot for s in states]), self.device)
        taken = tokens.index_select(0, upload(torch.tensor(rows, dtype=torch.long), self.device))
        one = torch.ones(len(rows), dtype=torch.int32, device=self.device)
        self._pool.index_put_((slots, taken.long()), one, accumulate=True)
        for state in states:
            state.consumed += 1

    def _ready(self, piece: SeqPiece) -> int:
        """The slot of the request's counts, each of its output tokens before this sample
        counted."""
        state = self._counts.get(piece.request_id)
        if state is not None and state.consumed == piece.sample_index:
            return state.slot
        output = piece.output_ids
        if output is None or len(output) != piece.sample_index:
            raise ValueError(
                f"{piece.request_id}: a penalized sample {piece.sample_index} without its "
                "output so far"
            )
        if state is None:
            state = self._counts[piece.request_id] = _Counts(self._take_slot(), 0)
        row = self._pool[state.slot]
        row.zero_()
        if output:
            ids = upload(torch.tensor(output, dtype=torch.long), self.device)
            row.index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        state.consumed = len(output)
        return state.slot

    def _take_slot(self) -> int:
        if not self._free:
            grown = max(4, 2 * self._pool.shape[0])
            width = self._pool.shape[1]
            pool = torch.zeros((grown, width), dtype=torch.int32, device=self.device)
            pool[: self._pool.shape[0]] = self._pool
            self._free = list(range(grown - 1, self._pool.shape[0] - 1, -1))
            self._pool = pool
        return self._free.pop()

    def _hold_back(
        self, logits: torch.Tensor, sampling: Sequence[SeqPiece], params: Sequence[SamplingParams]
    ) -> None:
        """The end-of-sequence and stop tokens of rows with fewer than `min_tokens` out."""
        entries = [
            (row, token)
            for row, (piece, p) in enumerate(zip(sampling, params, strict=True))
            if piece.sample_index < p.min_tokens
            for token in p.eos_ids
            if token < logits.shape[1]
        ]
        if entries:
            index = upload(torch.tensor(entries, dtype=torch.long).T.contiguous(), self.device)
            never = torch.full(  # filled on the device: no copy to wait for
                (len(entries),), float("-inf"), dtype=logits.dtype, device=self.device
            )
            logits.index_put_((index[0], index[1]), never)

    def _bias(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        entries = [
            (row, token, bias)
            for row, p in enumerate(params)
            for token, bias in p.logit_bias
            if token < logits.shape[1]
        ]
        if not entries:
            return
        rows, tokens, biases = zip(*entries, strict=True)
        index = upload(torch.tensor([rows, tokens], dtype=torch.long), self.device)
        values = upload(torch.tensor(biases, dtype=logits.dtype), self.device)
        logits.index_put_((index[0], index[1]), values, accumulate=True)
