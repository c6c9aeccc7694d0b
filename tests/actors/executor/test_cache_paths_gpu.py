"""On the GPU, with the real copy streams: a turn's tokens do not depend on where its history came
from. Swap-ins, evict-first copies and ahead-of-time swap-outs run on their own CUDA streams there
(layer-pipelined), which the CPU tests cannot exercise; a missing wait shows up as changed tokens.
With tiers this small nearly every swap-in comes with an evict-first copy in the same step, so a
swap-in issued alone is checked by `test_swap_gpu.py` (this test would not notice such swap-ins
being skipped).
"""

from __future__ import annotations

import random

import pytest
import torch

from pensieve.actors.config import CacheConfig, Policy, SchedulerConfig
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.request import Request
from pensieve.actors.wire.step import SamplingParams
from pensieve.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_CONVERSATIONS, TURNS, CONCURRENCY, MAX_TOKENS = 16, 3, 6, 16


def chat(
    policy: Policy, loaded, gpu_blocks: int, cpu_blocks: int, overlap: bool = True
) -> tuple[dict, Engine]:
    """Every conversation's turns, `CONCURRENCY` conversations at a time; outputs by turn."""
    cache = CacheConfig(32, gpu_blocks, cpu_blocks, policy, admission_reserve=0.0)
    runner = ModelRunner(loaded.model, cache, torch.device("cuda"), torch.float32)
    scheduling = SchedulerConfig(256, 64, loaded.config.max_context_len)
    cost = lambda context: 1.0 + context / 512  # noqa: E731
    engine = Engine(runner, cache, scheduling, cost, frozenset(), overlap=overlap)
    rng = random.Random(7)  # the same conversations for every policy
    vocab = loaded.config.vocab_size
    messages = {
        f"c{i}": [
            [rng.randrange(3, vocab) for _ in range(rng.randint(20, 120))] for _ in range(TURNS)
        ]
        for i in range(NUM_CONVERSATIONS)
    }
    history: dict[str, list[int]] = {c: [] for c in messages}
    outputs: dict[tuple[str, int], list[int]] = {}
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    queue = list(messages)
    live: dict[str, tuple[Request, int]] = {}
    while queue or live:
        while queue and len(live) < CONCURRENCY:
            conv = queue.pop(0)
            turn = sum(1 for key in outputs if key[0] == conv)
            prompt = history[conv] + messages[conv][turn]
            live[conv] = (engine.add_request(conv, prompt, sampling), turn)
        for request in engine.step().finished:
            _, turn = live.pop(request.conv_id)
            outputs[(request.conv_id, turn)] = list(request.output_ids)
            history[request.conv_id] = request.all_ids
            if turn + 1 < TURNS:
                queue.append(request.conv_id)
    engine.kv.check_invariants()
    return outputs, engine


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny-llama", "cuda", torch.float32, seed=3)


@pytest.fixture(scope="module")
def stateless(model) -> dict:
    """Sequential steps; the runs compared with it plan each step while the one before runs,
    its decodes fed (through CUDA graphs too) the tokens still on the device."""
    outputs, engine = chat(Policy.STATELESS, model, 256, 0, overlap=False)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # graphs replayed
    return outputs


@pytest.mark.parametrize("policy", [Policy.PENSIEVE, Policy.LRU, Policy.GPU_ONLY])
def test_gpu_every_cache_path_gives_the_same_tokens(model, stateless, policy):
    # 40 GPU blocks (1280 tokens) and 24 CPU blocks for 6 conversations of up to ~450 tokens:
    # hits, swaps and drops in one run (checked with these tiers on the CPU as well)
    outputs, engine = chat(policy, model, 40, 24)
    assert engine.overlap and outputs == stateless
    sources = engine.totals.sources
    stats = engine.runner.swap.stats
    assert sources.gpu > 0 and sources.recomputed > 0, sources
    if policy is not Policy.GPU_ONLY:
        assert sources.cpu > 0 and stats.bytes_in > 0 and stats.bytes_out > 0, (sources, stats)
