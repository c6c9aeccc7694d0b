"""The structured-output benchmark's xgrammar masks (`benchmarks/xgrammar_masks.py`), on the CPU
with SmolLM2's tokenizer: a batch of rows under a JSON schema, masked and sampled step by step
beside a free row, writes replies the schema validates (checked with llguidance, the library
the server uses), and the free row's logits are left as they are. Skipped where xgrammar is
not installed: it is no dependency of Pensieve."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.xgrammar_masks import TimedMasks, XGrammarMasks
from pensieve.actors.executor.sampler import apply_token_mask, sample_async
from pensieve.actors.wire.step import SamplingParams, SeqPiece
from pensieve.actors.wire.structured import Grammar
from pensieve.models.assets import smollm2_tokenizer

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"enum": [1, 2, 3]}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


class _Step:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def host_tokens(self) -> list[int]:
        return self.tokens


def test_rows_under_a_schema_write_what_it_allows() -> None:
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    tokenizer = smollm2_tokenizer()
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    masks = TimedMasks(XGrammarMasks(tokenizer, [eos], vocab))
    constrained = SamplingParams(grammar=Grammar.json_schema(SCHEMA))
    params = [constrained, SamplingParams(), constrained]
    out: dict[int, list[int]] = {0: [], 2: []}
    for index in range(40):
        pieces = [SeqPiece(f"r{r}", (1,), 5, 6, (0,), p, index) for r, p in enumerate(params)]
        masks.forget_absent(pieces)
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(index))
        free = logits[1].clone()
        rows, bitmask = masks.masks(pieces)  # type: ignore[misc]
        assert rows == [0, 2]
        apply_token_mask(logits, torch.tensor(rows), bitmask)
        assert torch.equal(logits[1], free)
        tokens = sample_async(logits, params, [index] * 3).tolist()
        masks.sampled(_Step(tokens), pieces)
        for row, written in out.items():
            if not written or written[-1] != eos:
                written.append(tokens[row])
    assert len(masks.seconds) == 40
    check = from_tokenizer(tokenizer, eos_token=[eos])
    for written in out.values():
        assert written[-1] == eos, tokenizer.decode(written)
        reply = json.loads(tokenizer.decode(written[:-1]))
        assert reply["n"] in (1, 2, 3) and len(reply["city"]) <= 8
        matcher = LLMatcher(check, Grammar.json_schema(SCHEMA).compiled(), log_level=0)
        assert matcher.consume_tokens(written) and matcher.is_stopped()
