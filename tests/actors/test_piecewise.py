"""The piecewise forward (everything but attention in per-bucket pieces) computes what the eager
forward does, writes the same K/V, and its padding rows touch nothing but the scratch block.

On a CPU the pieces run uncaptured: these tests check the buffers, the packing of the inputs and
the padding. test_cuda_graphs.py replays them as CUDA graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_cache import CopyOp, SwapOrders
from pensieve.actors.piecewise import token_buckets
from pensieve.actors.request import SamplingParams
from pensieve.actors.step import SeqPiece, StepPlan
from pensieve.models.loader import load_model

BLOCK = 16


@pytest.mark.parametrize("max_tokens", [2048, 256, 100, 8])
def test_token_buckets_cover_every_step_with_little_padding(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == tuple(sorted(set(buckets))) and buckets[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        size = next(b for b in buckets if b >= n)
        assert size - n < max(64, n)  # below 64 tokens of padding, or less than doubling


def random_plan(rng: random.Random, vocab: int, blocks: list[int]) -> StepPlan:
    """Decodes, prompts, and a recomputed prefix with its new prompt, over disjoint blocks."""
    pieces: list[SeqPiece] = []
    free = iter(blocks)
    sampled = SamplingParams()
    for i in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "prompt", "recompute"])
        end = rng.randint(2, 150)
        table = tuple(next(free) for _ in range(-(-end // BLOCK)))
        if kind == "decode":
            tokens = (rng.randrange(vocab),)
            pieces.append(SeqPiece(f"r{i}", tokens, end - 1, end, table, sampled))
        elif kind == "prompt":
            start = rng.randrange(end)
            tokens = tuple(rng.randrange(vocab) for _ in range(end - start))
            pieces.append(SeqPiece(f"r{i}", tokens, start, end, table, sampled))
        else:  # [0, cut) recomputed, [cut, mid) cached, [mid, end) the new prompt
            cut = rng.randrange(1, end)
            mid = rng.randint(cut, end - 1)
            prefix = tuple(rng.randrange(vocab) for _ in range(cut))
            prompt = tuple(rng.randrange(vocab) for _ in range(end - mid))
            pieces.append(SeqPiece(f"r{i}", prefix, 0, cut, table, None))
            pieces.append(SeqPiece(f"r{i}", prompt, mid, end, table, sampled))
    rng.shuffle(pieces)
    return StepPlan(tuple(pieces))


def test_piecewise_forward_matches_eager_and_writes_only_real_slots():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    loaded = load_model("preset:tiny-llama", "cpu", torch.float32, seed=seed % 1000)
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks=80)
    cpu = torch.device("cpu")
    eager = ModelRunner(loaded.model, cache, cpu, torch.float32, piecewise=False)
    pieces = ModelRunner(loaded.model, cache, cpu, torch.float32, max_step_tokens=300,
                         piecewise=True)  # fmt: skip
    assert eager.piecewise is None and pieces.piecewise is not None
    for layer, other in zip(eager.gpu_caches, pieces.gpu_caches, strict=True):
        layer.normal_(generator=torch.Generator().manual_seed(seed))
        other.copy_(layer)
    scratch = cache.num_gpu_blocks
    blocks = list(range(scratch))
    sizes = set()
    for _ in range(8):  # large steps and small ones in turn: stale inputs must not leak
        rng.shuffle(blocks)
        plan = random_plan(rng, loaded.config.vocab_size, blocks)
        assert pieces.piecewise.fits(plan.num_tokens), f"seed {seed}"
        sizes.add(next(b for b in pieces.piecewise.buckets if b >= plan.num_tokens))
        want = eager.logits(plan)
        got = pieces.logits(plan)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")
        for layer, other in zip(eager.gpu_caches, pieces.gpu_caches, strict=True):
            # every real block holds the same K/V; only the scratch block may differ
            torch.testing.assert_close(other[:scratch], layer[:scratch], rtol=1e-4, atol=1e-4)
    assert len(sizes) > 1, f"seed {seed}: one bucket only"


def test_steps_beyond_the_largest_bucket_run_eagerly():
    loaded = load_model("preset:tiny-llama", "cpu", torch.float32, seed=0)
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks=16)
    runner = ModelRunner(loaded.model, cache, torch.device("cpu"), torch.float32,
                         max_step_tokens=32, piecewise=True)  # fmt: skip
    eager = ModelRunner(loaded.model, cache, torch.device("cpu"), torch.float32)
    assert runner.piecewise is not None and not runner.piecewise.fits(33)
    plan = StepPlan((SeqPiece("a", tuple(range(3, 43)), 0, 40, (0, 1, 2), SamplingParams()),))
    torch.testing.assert_close(runner.logits(plan), eager.logits(plan))
    assert runner.piecewise.pieces == {}  # nothing was prepared for it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_pieces_match_eager_with_pipelined_swap_in():
    """Replayed pieces against the eager forward while every block of the step swaps in, layer
    by layer, at once: a piece that wrote K/V before its layer's copies landed would lose them."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    loaded = load_model("preset:tiny-llama", "cuda", torch.bfloat16, seed=seed % 1000)
    cache = CacheConfig(BLOCK, 80, 80, Policy.PENSIEVE)
    cuda = torch.device("cuda")
    eager = ModelRunner(loaded.model, cache, cuda, torch.bfloat16, cuda_graphs=False)
    graphs = ModelRunner(loaded.model, cache, cuda, torch.bfloat16, max_step_tokens=300)
    assert eager.piecewise is None and graphs.piecewise is not None
    for runner in (eager, graphs):
        for gpu, cpu in zip(runner.gpu_caches, runner.cpu_caches, strict=True):
            gpu.normal_(generator=torch.Generator("cuda").manual_seed(seed))
            cpu.normal_(generator=torch.Generator().manual_seed(seed))
    scratch, blocks = cache.num_gpu_blocks, list(range(cache.num_gpu_blocks))
    for _ in range(6):
        rng.shuffle(blocks)
        plan = random_plan(rng, loaded.config.vocab_size, blocks)
        used = sorted({b for p in plan.pieces for b in p.block_table})
        slots = rng.sample(range(cache.num_cpu_blocks), len(used))
        orders = SwapOrders(swap_in=[CopyOp(b, s) for b, s in zip(used, slots, strict=True)])
        results = []
        for runner in (eager, graphs):
            runner.swap.issue(orders)
            results.append(runner.logits(plan))
        want, got = results
        error = ((got - want).float().norm() / want.float().norm()).item()
        assert error < 2e-2, f"seed {seed}: relative error {error}"
        for layer, other in zip(eager.gpu_caches, graphs.gpu_caches, strict=True):
            torch.testing.assert_close(other[:scratch], layer[:scratch], rtol=2e-2, atol=2e-2)
    # clobber freed memory: a piece that reads a tensor it does not keep alive breaks here
    junk = [torch.full((1 << 20,), -7.0, device="cuda") for _ in range(64)]
    again = graphs.logits(plan)
    del junk
    assert torch.equal(again, got), f"seed {seed}"
