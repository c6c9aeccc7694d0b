"""Grammar-constrained sampling: one llguidance matcher per constrained request, advanced with
each token sampled for it, and the token masks of a step's constrained rows.

The matchers live here, beside the sampler, because the executor is what sees each token first:
the engine plans and launches step N+1 before it has read step N's tokens, so only the executor
can read the token step N sampled for a request before step N+1 samples the next. It reads it
after step N+1's forward is issued, so advancing the matchers and computing the masks run on
the host while the device runs the forward; the sampler then waits only for the masks' copy up.
Both are batched over the step's constrained rows on llguidance's own threads (`LLExecutor`):
the matchers take their tokens together, then the masks are filled together. Rows of
unconstrained requests are never touched.

A matcher is forgotten when a step leaves its request out, as the step channel forgets what it
caches of a request. The scheduler sends such a request's output so far with its next sampling
piece (`SeqPiece.output_ids`), and a fresh matcher replays it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pensieve.actors.wire.step import SeqPiece
from pensieve.actors.wire.structured import Grammar

logger = logging.getLogger(__name__)


class SampledTokens(Protocol):
    """A launched step's sampled tokens, one per row that samples (waits for the step)."""

    def host_tokens(self) -> list[int]: ...


@dataclass
class _Constrained:
    matcher: Any  # llguidance.LLMatcher
    consumed: int = 0  # output tokens it has taken
    # its samples in launched steps not read yet, oldest first: (the step, its row there)
    unread: list[tuple[SampledTokens, int]] = field(default_factory=list)


class GrammarMasks:
    """The matchers of the constrained requests one executor samples for."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int) -> None:
        """`tokenizer` makes the llguidance tokenizer (about a second for a large vocabulary:
        made at the first constrained request); `vocab_size`: the logits' width."""
        self._make_tokenizer = tokenizer
        self._tokenizer: Any = None
        self._executor: Any = None
        self._warming: Future[Any] | None = None
        self.vocab_size = vocab_size
        self._states: dict[str, _Constrained] = {}

    @staticmethod
    def from_hf(hf_tokenizer: Any, eos_token_ids: Iterable[int], vocab_size: int) -> GrammarMasks:
        """Masks over the vocabulary of a Hugging Face tokenizer, ending on any of its
        end-of-sequence tokens."""
        eos = sorted(eos_token_ids)

        def make() -> Any:
            import llguidance.hf

            return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos or None)

        return GrammarMasks(make, vocab_size)

    def warm(self) -> None:
        """Start making the llguidance tokenizer on a thread of its own now, rather than in the
        step that first samples a constrained request (where it holds up the whole batch)."""
        if self._tokenizer is None and self._warming is None:
            self._warming = ThreadPoolExecutor(1, "pensieve-grammar").submit(self._make_tokenizer)

    @property
    def num_constrained(self) -> int:
        return len(self._states)

    def forget_absent(self, pieces: Iterable[SeqPiece]) -> None:
        """Forget the matchers of requests the step leaves out."""
        if self._states:
            present = {piece.request_id for piece in pieces}
            for request_id in [r for r in self._states if r not in present]:
                del self._states[request_id]

    def masks(self, sampling: Sequence[SeqPiece]) -> tuple[list[int], torch.Tensor] | None:
        """For a step whose pieces that sample are `sampling` (in the order of its logits'
        rows): the rows of constrained requests and their masks [rows, ceil(vocab / 32)] int32
        on the host (bit j of word i allows token 32 * i + j); None when no row is constrained.
        Reads the tokens sampled for them by earlier steps first (waiting for those steps)."""
        rows = [i for i, piece in enumerate(sampling) if piece.sampling.grammar is not None]  # type: ignore[union-attr]
        if not rows:
            return None
        tokenizer = self._ensure_tokenizer()
        words = (tokenizer.vocab_size + 31) // 32
        # every row is written whole below (a mask filled, or EOS alone): no fill beforehand,
        # which for a batch of rows runs on torch's threads and took longer than the masks
        bitmask = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=_pinned())
        live: list[tuple[Any, int]] = []
        for k, state in enumerate(self._catch_up([sampling[row] for row in rows])):
            if state.matcher.is_stopped() or state.matcher.is_error():
                # its turn is over (this token is discarded), or the grammar failed: only an
                # end-of-sequence token ends it
                self._allow_eos(bitmask[k])
            else:
                live.append((state.matcher, k))
        if live:
            from llguidance.torch import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor, live, bitmask)
        return rows, bitmask

    def sampled(self, launched: SampledTokens, sampling: Sequence[SeqPiece]) -> None:
        """`launched` samples the rows `sampling` describes: its constrained requests' matchers
        take their tokens when a later step needs them."""
        for row, piece in enumerate(sampling):
            state = self._states.get(piece.request_id)
            if state is not None:
                state.unread.append((launched, row))

    def _catch_up(self, pieces: Sequence[SeqPiece]) -> list[_Constrained]:
        """The requests' matchers, each having taken every output token before its sample:
        the matchers behind take their next token together, on llguidance's threads, until
        none is behind (one round, unless a step was read late)."""
        states = [self._states.get(piece.request_id) for piece in pieces]
        while True:
            behind = [
                (piece, state)
                for piece, state in zip(pieces, states, strict=True)
                if state is not None and state.unread and state.consumed < piece.sample_index
            ]
            if not behind:
                break
            taken = []
            for _, state in behind:
                launched, row = state.unread.pop(0)
                taken.append((state.matcher, launched.host_tokens()[row]))
                state.consumed += 1
            for (piece, state), ok in zip(
                behind, self._executor.consume_token_par(taken), strict=True
            ):
                if not ok:
                    logger.warning("%s: %s", piece.request_id, state.matcher.get_error())
        return [
            self._start(piece) if state is None or state.consumed != piece.sample_index else state
            for piece, state in zip(pieces, states, strict=True)
        ]

    def _start(self, piece: SeqPiece) -> _Constrained:
        """A fresh matcher for the request, having taken its output so far."""
        output = piece.output_ids or ()
        if len(output) != piece.sample_index:
            raise ValueError(
                f"{piece.request_id}: a constrained sample {piece.sample_index} without its "
                "output so far"
            )
        from llguidance import LLMatcher

        grammar: Grammar = piece.sampling.grammar  # type: ignore[union-attr,assignment]
        matcher = LLMatcher(self._ensure_tokenizer(), grammar.compiled(), log_level=0)
        if matcher.is_error():
            logger.warning("%s: grammar refused: %s", piece.request_id, matcher.get_error())
        elif output and not matcher.consume_tokens(list(output)):
            logger.warning("%s: %s", piece.request_id, matcher.get_error())
        state = self._states[piece.request_id] = _Constrained(matcher, len(output))
        return state

    def _ensure_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from llguidance import LLExecutor

            warming = self._warming
            self._tokenizer = self._make_tokenizer() if warming is None else warming.result()
            self._executor = LLExecutor()
        return self._tokenizer

    def _allow_eos(self, mask: torch.Tensor) -> None:  # mask: [words] int32
        mask.zero_()
        eos = self._tokenizer.eos_token
        for token in eos if isinstance(eos, list) else [eos]:
            word, bit = divmod(token, 32)
            mask[word] |= _bit(bit)


def _bit(bit: int) -> int:
    """Bit `bit` of an int32 word, as a signed value."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit


def _pinned() -> bool:
    return torch.cuda.is_available()
