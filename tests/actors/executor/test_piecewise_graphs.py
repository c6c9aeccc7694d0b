"""Steps with prefill pieces replayed from graphs cut at attention give the eager forward's logits
and write the same K/V, and nothing else (GPU only)."""

from __future__ import annotations

import random

import pytest
import torch

from pensieve.actors.config import CacheConfig
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.executor.piecewise_graphs import TOKEN_BUCKETS
from pensieve.actors.wire.step import SamplingParams, SeqPiece, StepPlan
from pensieve.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK = 16
BLOCKS_PER_SEQ = 64  # 1,024 positions: the tiny models' context


def step(
    rng: random.Random,
    num_decodes: int,
    prompts: list[tuple[int, int]],
    vocab: int,
    first_seq: int = 0,
) -> StepPlan:
    """Decodes at random contexts, then prompt pieces (start, end): a piece starting past 0
    continues a cached prefix; a prefix chunk of its own (not sampling) comes before each
    prompt that starts past 96, sharing its block table. Each sequence owns its blocks."""
    pieces = []
    for i in range(num_decodes):
        seq = first_seq + i
        table = tuple(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))
        end = rng.randint(2, 1000)
        pieces.append(
            SeqPiece(f"d{seq}", (rng.randrange(vocab),), end - 1, end, table, SamplingParams())
        )
    for j, (start, end) in enumerate(prompts):
        seq = first_seq + num_decodes + j
        table = tuple(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))
        cut = start // 2 if start > 96 else start
        if cut < start:  # a recomputed prefix beside the new prompt
            ids = tuple(rng.randrange(vocab) for _ in range(start - cut))
            pieces.append(SeqPiece(f"p{seq}", ids, cut, start, table, None))
        ids = tuple(rng.randrange(vocab) for _ in range(end - start))
        pieces.append(SeqPiece(f"p{seq}", ids, start, end, table, SamplingParams()))
    return StepPlan(tuple(pieces))


def runners(model: str, dtype: torch.dtype, seqs: int) -> tuple[ModelRunner, ModelRunner]:
    loaded = load_model(model, "cuda", dtype, seed=5)
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks=seqs * BLOCKS_PER_SEQ)
    eager = ModelRunner(loaded.model, cache, torch.device("cuda"), dtype, cuda_graphs=False)
    graphed = ModelRunner(loaded.model, cache, torch.device("cuda"), dtype)
    assert graphed.mixed_graphs is not None
    for a, b in zip(eager.gpu_caches, graphed.gpu_caches, strict=True):
        a.normal_()
        b.copy_(a)
    return eager, graphed


def assert_same_kv(eager: ModelRunner, graphed: ModelRunner, atol: float) -> None:
    """Every block but the scratch block (the last, which padding rows write) alike."""
    for layer, (a, b) in enumerate(zip(eager.gpu_caches, graphed.gpu_caches, strict=True)):
        torch.testing.assert_close(
            b[:-1], a[:-1], atol=atol, rtol=0, msg=lambda m, i=layer: f"layer {i}: {m}"
        )


@pytest.mark.parametrize(
    ("model", "dtype"),
    [
        ("preset:tiny-llama", torch.float32),
        ("preset:tiny-opt", torch.float32),
        ("preset:tiny-qwen3", torch.float32),
        ("preset:tiny-llama", torch.bfloat16),
    ],
)
def test_mixed_steps_give_the_eager_logits_and_kv(model: str, dtype: torch.dtype) -> None:
    """A sequence of steps of several buckets, each smaller one after a larger: the padding
    rows must write the scratch block only, whatever slots an earlier step left."""
    rng = random.Random(11)
    eager, graphed = runners(model, dtype, seqs=24)
    vocab = eager.config.vocab_size
    shapes = [
        (3, [(0, 290)]),  # bucket 320
        (5, [(0, 40), (200, 800)]),  # a new bucket, captured after a step ran
        (2, [(150, 360)]),  # 75 + 210 + 2 tokens: the first step's bucket, with fewer
        (0, [(0, TOKEN_BUCKETS[0])]),  # exactly a bucket
        (7, [(500, 501), (0, 3)]),  # a one-token prompt past a cached prefix, a short one
    ]
    tight = dtype == torch.float32
    for n, (decodes, prompts) in enumerate(shapes):
        plan = step(rng, decodes, prompts, vocab, first_seq=n * 4 % 12)
        want = eager.logits(plan)
        got = graphed.logits(plan)
        assert got.shape == want.shape
        if tight:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:
            error = ((got - want).norm() / want.norm()).item()
            assert error < 2e-2, f"step {n}: relative error {error}"
        assert_same_kv(eager, graphed, atol=1e-5 if tight else 2e-2)
    assert graphed.mixed_graphs is not None
    assert set(graphed.mixed_graphs.captured) == {8, 320, 768}
    for pieces in graphed.mixed_graphs.captured.values():
        assert len(pieces.graphs) == eager.config.num_layers + 1


def test_a_replay_reads_nothing_it_does_not_keep_alive() -> None:
    rng = random.Random(3)
    _, graphed = runners("preset:tiny-llama", torch.bfloat16, seqs=8)
    plan = step(rng, 4, [(0, 100), (300, 420)], graphed.config.vocab_size)
    first = graphed.logits(plan).clone()
    junk = [
        torch.full((size,), -7, dtype=torch.int32, device="cuda")
        for size in [64] * 4000 + [1 << 20] * 64
    ]
    again = graphed.logits(plan)
    del junk
    assert torch.equal(again, first)


def test_capture_all_leaves_nothing_to_capture_later() -> None:
    _, graphed = runners("preset:tiny-llama", torch.bfloat16, seqs=8)
    assert graphed.mixed_graphs is not None
    count = graphed.mixed_graphs.capture_all(max_tokens=500)
    captured = set(graphed.mixed_graphs.captured)
    assert len(captured) == count and max(captured) == 512
    rng = random.Random(0)
    for prompts in ([(0, 1)], [(0, 497)], [(40, 300)]):
        graphed.logits(step(rng, 3, prompts, graphed.config.vocab_size))
    assert set(graphed.mixed_graphs.captured) == captured


def test_a_step_past_the_largest_bucket_runs_eagerly() -> None:
    rng = random.Random(1)
    eager, graphed = runners("preset:tiny-llama", torch.float32, seqs=8)
    plan = step(
        rng, 2, [(0, 1000), (0, 1000), (0, TOKEN_BUCKETS[-1] - 1999)], graphed.config.vocab_size
    )
    torch.testing.assert_close(graphed.logits(plan), eager.logits(plan), atol=1e-4, rtol=1e-4)
    assert graphed.mixed_graphs is not None and not graphed.mixed_graphs.captured
