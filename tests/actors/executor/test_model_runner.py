"""The model runner's eager step: pieces may come in any order; logits follow the plan's order."""

from __future__ import annotations

import torch

from pensieve.actors.config import CacheConfig
from pensieve.actors.executor.model_runner import ModelRunner, decodes_first
from pensieve.actors.wire.step import SamplingParams, SeqPiece, StepPlan
from pensieve.models.loader import load_model


def tiny_runner() -> ModelRunner:
    """A runner of the tiny preset on the CPU, its KV cache filled with random values."""
    loaded = load_model("preset:tiny-llama", "cpu", torch.float32, seed=3)
    cache = CacheConfig(block_size=16, num_gpu_blocks=64)
    runner = ModelRunner(loaded.model, cache, torch.device("cpu"), torch.float32)
    for layer in runner.gpu_caches:
        layer.normal_(generator=torch.Generator().manual_seed(1))
    return runner


def test_logits_follow_plan_order_whatever_the_mix_of_decodes_and_prompts() -> None:
    runner = tiny_runner()
    sampled = SamplingParams()
    pieces = [
        SeqPiece("a", tuple(range(3, 23)), 10, 30, (0, 1), sampled),  # a prompt, samples
        SeqPiece("b", (7,), 40, 41, (2, 3, 4), sampled),  # a decode
        SeqPiece("c", tuple(range(5, 15)), 0, 10, (5,), None),  # a recomputed prefix
        SeqPiece("c", tuple(range(9, 21)), 20, 32, (5, 6), sampled),  # its new prompt
        SeqPiece("d", (11,), 16, 17, (7, 8), sampled),  # a decode
    ]
    mixed = runner.logits(StepPlan(tuple(pieces)))
    singles = [
        runner.logits(StepPlan((p,)))
        for p in pieces
        if p.sampling is not None and p.request_id != "c"
    ]
    assert mixed.shape == (4, runner.config.vocab_size)
    # each sampling piece's row equals what that piece gives alone (c's pair runs together)
    pair = runner.logits(StepPlan((pieces[2], pieces[3])))
    want = torch.cat([singles[0], singles[1], pair, singles[2]])
    torch.testing.assert_close(mixed, want, rtol=1e-4, atol=1e-4)


def test_decodes_run_longest_last_and_tokens_come_back_in_plan_order() -> None:
    """The runner executes decodes shortest context first (the attention kernel starts the
    highest tiles, so the longest, first) and the rest after them, but a launch's tokens, and
    the rows that feed the next step, stay keyed to the plan as given."""
    runner = tiny_runner()
    sampled = SamplingParams()
    pieces = (
        SeqPiece("long", (7,), 60, 61, (0, 1, 2, 3), sampled),
        SeqPiece("prompt", tuple(range(3, 13)), 0, 10, (4,), sampled),
        SeqPiece("short", (9,), 5, 6, (5,), sampled),
        SeqPiece("middle", (11,), 30, 31, (6, 7), sampled),
    )
    plan = StepPlan(pieces)
    ordered = decodes_first(plan)
    assert [p.request_id for p in ordered.pieces] == ["short", "middle", "long", "prompt"]
    assert decodes_first(ordered) is ordered  # nothing to reorder: the same plan
    launched = runner.launch(plan)
    alone = {p.request_id: runner.execute(StepPlan((p,)))[0] for p in pieces}
    assert launched.plan is plan and launched.executed == ordered
    assert launched.result() == [alone[p.request_id] for p in pieces]
    for request_id, row in launched.rows.items():  # what the next step's decodes are fed
        assert int(launched.tokens[row]) == alone[request_id]
