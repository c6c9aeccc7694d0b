"""Grammar-constrained sampling on the executor's side: the token mask reaches only the rows of
constrained requests, refuses every token it does not allow (those past its words included),
and a request's matcher follows the tokens sampled for it across steps, also after a step left
it out (it replays the output the scheduler sends)."""

from __future__ import annotations

import json

import torch

from pensieve.actors.executor.grammar import GrammarMasks
from pensieve.actors.executor.sampler import apply_token_mask, sample_async
from pensieve.actors.wire.step import SamplingParams, SeqPiece
from pensieve.actors.wire.structured import Grammar
from pensieve.models.assets import smollm2_tokenizer

VOCAB = 100


def _bitmask(allowed: list[list[int]], words: int) -> torch.Tensor:  # [R, words] int32
    mask = torch.zeros((len(allowed), words), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            mask[row, token // 32] |= 1 << (token % 32)
    return mask.to(torch.int32)  # bit 31 wraps to the sign, as llguidance writes it


def test_the_mask_reaches_only_the_constrained_rows() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    allowed = [[3, 31, 64], [99]]
    apply_token_mask(logits, torch.tensor([1, 3]), _bitmask(allowed, 4))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, tokens in zip((1, 3), allowed, strict=True):
        kept = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert kept == tokens
        assert torch.equal(logits[row, tokens], before[row, tokens])
    greedy = sample_async(logits, [SamplingParams()] * 4, [0] * 4).tolist()
    assert greedy[0] == before[0].argmax() and greedy[2] == before[2].argmax()
    assert greedy[1] in allowed[0] and greedy[3] == 99


def test_tokens_past_the_mask_words_are_refused() -> None:
    logits = torch.zeros(1, VOCAB)
    apply_token_mask(logits, torch.tensor([0]), _bitmask([[0, 63]], 2))  # words for 64 tokens
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 63]


class _Step:
    """A launched step whose tokens are known."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def host_tokens(self) -> list[int]:
        return self.tokens


def test_a_sampled_row_under_a_grammar_writes_what_it_allows() -> None:
    tokenizer = smollm2_tokenizer()
    masks = GrammarMasks.from_hf(tokenizer, {tokenizer.eos_token_id}, len(tokenizer))
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    grammar = Grammar.json_schema(schema)
    constrained = SamplingParams(grammar=grammar)
    vocab = len(tokenizer)
    out: list[int] = []
    for index in range(40):
        pieces = [
            SeqPiece("free", (1,), 5, 6, (0,), SamplingParams(), index),
            SeqPiece("json", (1,), 5, 6, (0,), constrained, index),
        ]
        if index == 5:  # a step leaves the request out: its matcher is forgotten
            masks.forget_absent(pieces[:1])
            pieces[1] = SeqPiece("json", (1,), 5, 6, (0,), constrained, index, tuple(out))
        logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(index))
        free = logits[0].clone()
        rows, bitmask = masks.masks(pieces)  # type: ignore[misc]
        assert rows == [1]
        apply_token_mask(logits, torch.tensor(rows), bitmask)
        tokens = sample_async(logits, [p.sampling for p in pieces], [index] * 2)  # type: ignore[misc]
        assert torch.equal(logits[0], free)
        masks.sampled(_Step(tokens.tolist()), pieces)
        out.append(int(tokens[1]))
        if out[-1] == tokenizer.eos_token_id:
            break
    assert out[-1] == tokenizer.eos_token_id, tokenizer.decode(out)
    reply = json.loads(tokenizer.decode(out[:-1]))
    assert isinstance(reply["ok"], bool) and reply["n"] in (1, 2) and len(reply) == 2


def test_a_batch_of_constrained_rows_gets_the_masks_each_row_gets_alone() -> None:
    """The matchers of a step's constrained rows take their tokens and fill their masks
    together (on llguidance's threads): every mask is the one a matcher of that row alone,
    advanced and filled one call at a time, gives."""
    import llguidance.hf
    from llguidance import LLMatcher
    from llguidance.torch import fill_next_token_bitmask

    tokenizer = smollm2_tokenizer()
    eos = tokenizer.eos_token_id
    masks = GrammarMasks.from_hf(tokenizer, {eos}, len(tokenizer))
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"enum": [1, 2, 3]}},
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    grammars = [
        Grammar.json_schema(schema),
        Grammar("regex", r"(yes|no), [a-z ]{1,12}\."),
        None,  # a free row between constrained ones
        Grammar.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 3}),
        Grammar.json_schema(schema),
        None,
    ]
    params = [SamplingParams(grammar=g) for g in grammars]
    alone_tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=[eos])
    alone = {
        row: LLMatcher(alone_tokenizer, g.compiled(), log_level=0)
        for row, g in enumerate(grammars)
        if g is not None
    }
    vocab = len(tokenizer)
    for index in range(30):
        pieces = [SeqPiece(f"r{r}", (1,), 5, 6, (0,), p, index) for r, p in enumerate(params)]
        rows, bitmask = masks.masks(pieces)  # type: ignore[misc]
        assert rows == sorted(alone)
        for k, row in enumerate(rows):
            expected = torch.zeros((1, bitmask.shape[1]), dtype=torch.int32)
            matcher = alone[row]
            if matcher.is_stopped() or matcher.is_error():
                expected[0] = _bitmask([[eos]], bitmask.shape[1])[0]
            else:
                fill_next_token_bitmask(matcher, expected)
            assert torch.equal(bitmask[k], expected[0]), (index, row)
        logits = torch.randn(len(pieces), vocab, generator=torch.Generator().manual_seed(index))
        apply_token_mask(logits, torch.tensor(rows), bitmask)
        tokens = sample_async(logits, params, [index] * len(pieces)).tolist()
        masks.sampled(_Step(tokens), pieces)
        for row, matcher in alone.items():
            matcher.consume_token(tokens[row])
    assert all(m.is_stopped() for m in alone.values())  # each wrote its whole grammar


def test_a_filled_mask_row_is_written_whole_whatever_the_buffer_held() -> None:
    """The executor's masks are not cleared before they are filled (`GrammarMasks.masks`): a
    row llguidance fills must come out the same over a buffer of ones as over one of zeros."""
    from llguidance import LLExecutor, LLMatcher
    from llguidance.hf import from_tokenizer
    from llguidance.torch import fill_next_token_bitmask_par

    tokenizer = smollm2_tokenizer()
    words = (len(tokenizer) + 31) // 32
    llg = from_tokenizer(tokenizer, eos_token=tokenizer.eos_token_id)
    executor = LLExecutor()
    grammar = Grammar.json_schema({"type": "object", "properties": {"n": {"enum": [1, 2]}}})
    matchers = [LLMatcher(llg, grammar.compiled(), log_level=0) for _ in range(3)]
    assert matchers[1].consume_tokens(tokenizer.encode('{"n', add_special_tokens=False))
    zeros = torch.zeros((3, words), dtype=torch.int32)
    ones = torch.full((3, words), -1, dtype=torch.int32)
    for bitmask in (zeros, ones):
        fill_next_token_bitmask_par(executor, [(m, k) for k, m in enumerate(matchers)], bitmask)
    assert torch.equal(zeros, ones)
    assert not torch.equal(zeros[0], zeros[1])  # rows in other states: other masks
