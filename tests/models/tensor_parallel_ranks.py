"""Tiny models run through the ModelRunner as one rank or as each of N tensor-parallel ranks,
for the parity tests (CPU with gloo; GPU with NCCL).

`run_ranks` starts N processes of `rank_main`, which each build the same model (same seeded
weights), keep their shard, run `exercise` and save what it returns for the test to compare
with the same run on one rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pensieve.actors.config import ALL_REDUCE_ENV, CacheConfig
from pensieve.actors.executor.model_runner import Launched, ModelRunner
from pensieve.actors.wire.step import PLACEHOLDER, SamplingParams, SeqPiece, StepPlan
from pensieve.models import PRESETS, CausalLM, ModelConfig, build_model, init_random_
from pensieve.models.tensor_parallel import NCCL_ENV, TensorShard, shard_model

# every layer kind: GQA, biases on every linear layer with an odd vocabulary (padded shards),
# per-head QK-norm with a tied head, and OPT
CASES: dict[str, ModelConfig] = {
    "llama-gqa": PRESETS["tiny-llama"],
    "llama-biases": dataclasses.replace(
        PRESETS["tiny-llama"], qkv_bias=True, o_bias=True, mlp_bias=True, vocab_size=509
    ),
    "qwen3-tied": dataclasses.replace(PRESETS["tiny-qwen3"], num_kv_heads=2),
    "opt": PRESETS["tiny-opt"],
}
BLOCK_SIZE = 16
PROMPTS = [list(range(3, 40)), [5, 9, 11, 400, 7, 3, 2, 80, 81, 82, 90]]
NEW_TOKENS = 6


def build(config: ModelConfig, device: torch.device) -> CausalLM:
    """The whole model with seeded random weights, biases included (init_random_ zeroes them)."""
    model = build_model(config, device, torch.float32)
    init_random_(model, seed=3)
    generator = torch.Generator(device=device).manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02, generator=generator)
    return model


def exercise(runner: ModelRunner) -> dict[str, Any]:
    """The logits of a mixed step, greedy tokens of prefill then decodes fed on the device, and
    tokens drawn at temperature 1 without a seed."""
    greedy, hot = SamplingParams(max_tokens=64), SamplingParams(temperature=1.0, max_tokens=64)
    tables = [tuple(range(0, 8)), tuple(range(8, 16))]
    first = StepPlan(
        tuple(
            SeqPiece(f"s{i}", tuple(p), 0, len(p), tables[i], greedy) for i, p in enumerate(PROMPTS)
        )
    )
    logits = runner.logits(first).cpu()
    launched: Launched = runner.launch(first)
    tokens = [launched.result()]
    for step in range(NEW_TOKENS - 1):
        pieces = tuple(
            SeqPiece(f"s{i}", (PLACEHOLDER,), len(p) + step, len(p) + step + 1, tables[i], greedy)
            for i, p in enumerate(PROMPTS)
        )
        launched = runner.launch(StepPlan(pieces), feed=launched)
        tokens.append(launched.result())
    end = len(PROMPTS[0]) + NEW_TOKENS - 1
    drawn = runner.execute(StepPlan((SeqPiece("s0", (9,) * 4, end, end + 4, tables[0], hot),)))
    return {"logits": logits, "tokens": tokens, "drawn": drawn, "all_reduce": runner.all_reduce}


def runner_for(model: CausalLM, device: torch.device, shard: TensorShard | None) -> ModelRunner:
    cache = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=64)
    return ModelRunner(model, cache, device, torch.float32, shard=shard)


def one_rank(case: str, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    return exercise(runner_for(build(CASES[case], device), device, None))


def rank_main(rank: int, world_size: int, backend: str, store: str, out: str) -> None:
    if backend == "gloo":
        torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    torch.manual_seed(rank)  # unseeded draws differ by rank unless the runner shares them
    try:
        shard = TensorShard(rank, world_size)
        for case, config in CASES.items():
            model = shard_model(build(config, device), shard)
            result = exercise(runner_for(model, device, shard))
            torch.save(result, Path(out) / f"{case}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # the results are saved: leave without the interpreter's finalization, where a gloo group's
    # worker threads, when something still holds the group, can abort the process (SIGABRT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    world_size: int, backend: str, tmp: Path, all_reduce: str = "nccl"
) -> dict[str, list[dict[str, Any]]]:
    """Every case's results on each of `world_size` ranks: {case: [rank 0's, rank 1's, ...]};
    the ranks sum as `all_reduce` (PENSIEVE_ALL_REDUCE) says."""
    os.environ.update(NCCL_ENV)  # the GPU machines keep NVLink multicast off
    os.environ[ALL_REDUCE_ENV] = all_reduce  # the ranks inherit it
    try:
        mp.spawn(rank_main, (world_size, backend, str(tmp / "store"), str(tmp)), nprocs=world_size)
    finally:
        del os.environ[ALL_REDUCE_ENV]
    return {
        case: [torch.load(tmp / f"{case}.rank{r}.pt") for r in range(world_size)] for case in CASES
    }
