"""The executor's grammar masks built with xgrammar instead of llguidance, for the comparison in
`benchmarks/structured_output.py` (`--backends llguidance,xgrammar`): the interface the model
runner calls (`forget_absent`, `masks`, `sampled`) as `actors/executor/grammar.py` has it, each
step's constrained matchers advanced and their masks filled in one batch on xgrammar's threads
(`BatchGrammarMatcher`). A JSON schema is compiled with llguidance's compact separators, so
both libraries allow the same replies; regular expressions are compiled too, Lark grammars
are not. xgrammar is imported here only: it is no dependency of Pensieve.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pensieve.actors.executor.grammar import SampledTokens, _pinned
from pensieve.actors.wire.step import SeqPiece
from pensieve.actors.wire.structured import JSON_OPTIONS, Grammar


@dataclass
class _Constrained:
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int = 0
    unread: list[tuple[SampledTokens, int]] = field(default_factory=list)


class XGrammarMasks:
    """The matchers, in xgrammar, of the constrained requests one executor samples for."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int], vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.eos = sorted(eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=self.eos
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info)
        self._batch = xgrammar.BatchGrammarMatcher()
        self._compiled: dict[Grammar, Any] = {}
        self._states: dict[str, _Constrained] = {}

    def forget_absent(self, pieces: Iterable[SeqPiece]) -> None:
        if self._states:
            present = {piece.request_id for piece in pieces}
            for request_id in [r for r in self._states if r not in present]:
                del self._states[request_id]

    def masks(self, sampling: Sequence[SeqPiece]) -> tuple[list[int], torch.Tensor] | None:
        """As `GrammarMasks.masks`: the constrained rows and their masks [rows, words] int32."""
        rows = [i for i, piece in enumerate(sampling) if piece.sampling.grammar is not None]  # type: ignore[union-attr]
        if not rows:
            return None
        states = self._catch_up([sampling[row] for row in rows])
        # written whole below, as the executor's: no fill beforehand (allocate_token_bitmask's)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=_pinned())
        live = [k for k, state in enumerate(states) if not state.matcher.is_terminated()]
        for k in set(range(len(rows))) - set(live):  # ended: only an end of sequence
            bitmask[k].zero_()
            for token in self.eos:
                bitmask[k, token // 32] |= _bit(token % 32)
        if live:
            matchers = [states[k].matcher for k in live]
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, live)
        return rows, bitmask

    def sampled(self, launched: SampledTokens, sampling: Sequence[SeqPiece]) -> None:
        for row, piece in enumerate(sampling):
            state = self._states.get(piece.request_id)
            if state is not None:
                state.unread.append((launched, row))

    def _catch_up(self, pieces: Sequence[SeqPiece]) -> list[_Constrained]:
        states = [self._states.get(piece.request_id) for piece in pieces]
        while True:
            behind = [
                state
                for piece, state in zip(pieces, states, strict=True)
                if state is not None and state.unread and state.consumed < piece.sample_index
            ]
            if not behind:
                break
            tokens = []
            for state in behind:
                launched, row = state.unread.pop(0)
                tokens.append(launched.host_tokens()[row])
                state.consumed += 1
            self._xgr.BatchGrammarMatcher.batch_accept_token([s.matcher for s in behind], tokens)
        return [
            self._start(piece) if state is None or state.consumed != piece.sample_index else state
            for piece, state in zip(pieces, states, strict=True)
        ]

    def _start(self, piece: SeqPiece) -> _Constrained:
        grammar: Grammar = piece.sampling.grammar  # type: ignore[union-attr,assignment]
        matcher = self._xgr.GrammarMatcher(self._compile(grammar))
        for token in piece.output_ids or ():
            matcher.accept_token(token)
        state = self._states[piece.request_id] = _Constrained(matcher, piece.sample_index)
        return state

    def _compile(self, grammar: Grammar) -> Any:
        if grammar not in self._compiled:
            if grammar.kind == "json_schema":
                separators = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])
                self._compiled[grammar] = self._compiler.compile_json_schema(
                    grammar.source, any_whitespace=False, separators=separators
                )
            elif grammar.kind == "regex":
                self._compiled[grammar] = self._compiler.compile_regex(grammar.source)
            else:
                raise ValueError("a Lark grammar is compiled by llguidance only")
        return self._compiled[grammar]


def _bit(bit: int) -> int:
    """Bit `bit` of an int32 word, as a signed value."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit


class TimedMasks:
    """Grammar masks (either library's) that keep how long each step's `masks` worked: the wait
    for the earlier steps' tokens, which both libraries need, is left out."""

    def __init__(self, masks: Any) -> None:
        self.inner = masks
        self.seconds: list[float] = []
        self._unread: list[SampledTokens] = []

    def forget_absent(self, pieces: Iterable[SeqPiece]) -> None:
        self.inner.forget_absent(pieces)

    def masks(self, sampling: Sequence[SeqPiece]) -> tuple[list[int], torch.Tensor] | None:
        for launched in self._unread:  # waits for those steps; their tokens are kept
            launched.host_tokens()
        self._unread.clear()
        begin = time.perf_counter()
        found = self.inner.masks(sampling)
        if found is not None:
            self.seconds.append(time.perf_counter() - begin)
        return found  # type: ignore[no-any-return]

    def sampled(self, launched: SampledTokens, sampling: Sequence[SeqPiece]) -> None:
        self._unread.append(launched)
        self.inner.sampled(launched, sampling)
