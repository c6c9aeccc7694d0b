"""The host-only mask benchmark (`benchmarks/grammar_masks.py`) with llguidance, the library the
server uses: the document its rows take is one the schema allows, token for token, and every
step of a batch is timed with a mask for each row."""

from __future__ import annotations

from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from benchmarks.grammar_masks import document, make, measure
from benchmarks.structured_output import SCHEMA
from pensieve.actors.wire.structured import Grammar
from pensieve.models.assets import smollm2_tokenizer


def test_the_rows_take_a_document_the_schema_allows_and_each_step_is_timed() -> None:
    tokenizer = smollm2_tokenizer()
    tokens = document(24, tokenizer)
    assert len(tokens) == 24
    matcher = LLMatcher(
        from_tokenizer(tokenizer, eos_token=tokenizer.eos_token_id),
        Grammar.json_schema(SCHEMA).compiled(),
        log_level=0,
    )
    assert matcher.consume_tokens(tokens) and not matcher.is_error()
    seconds = measure(make("llguidance", tokenizer), tokens, batch=3)
    assert len(seconds) == len(tokens) - 1 and all(s > 0 for s in seconds)
