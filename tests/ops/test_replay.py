"""End to end through `pensieve replay` on the real SmolLM2-135M-Instruct, fp32 on CPU.

The invariant: a turn's greedy tokens do not depend on where its history came from (GPU hit,
CPU swap-in, recomputation of dropped chunks, full re-prefill). Transformers is the reference.
"""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest
import torch

from pensieve.actors.config import Policy
from pensieve.ops.cli import main
from pensieve.ops.factory import EngineOptions, assemble
from pensieve.ops.replay import ReplayOptions, replay
from pensieve.ops.sharegpt import load_conversations

pytestmark = pytest.mark.slow


def run_replay(smollm2, chat, path: Path, policy: Policy, gpu_tokens: int, cpu_tokens: int,
               concurrency: int = 6, data_dir: Path | None = None) -> tuple[list[dict], object]:  # fmt: skip
    options = EngineOptions(
        model="smollm2",
        policy=policy,
        gpu_cache_tokens=gpu_tokens,
        cpu_cache_tokens=cpu_tokens,
        max_batch_tokens=512,
    )
    built = assemble(options, smollm2, chat)
    out = io.BytesIO()
    replay_options = ReplayOptions(max_new_tokens=24, concurrency=concurrency)
    replay(built, load_conversations(path), replay_options, out, data_dir)
    built.engine.kv.check_invariants()
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    return lines, built


def tokens_by_turn(lines: list[dict]) -> dict[tuple[str, int], list[int]]:
    return {(d["conversation_id"], d["turn"]): d["output_token_ids"] for d in lines}


def test_three_turn_chat_matches_transformers(tmp_path, smollm2):
    from transformers import AutoModelForCausalLM

    from pensieve.models.assets import smollm2_gguf_path

    chat_file = tmp_path / "chat.jsonl"
    turns = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"]
    record = {"id": "chat-1", "conversations": [{"from": "human", "value": t} for t in turns]}
    chat_file.write_bytes(orjson.dumps(record) + b"\n")
    out = tmp_path / "out.jsonl"
    argv = [
        "replay", str(chat_file), "--model", "smollm2", "--out", str(out),
        "--max-new-tokens", "40", "--emit-token-ids", "--data-dir", str(tmp_path / "db"),
    ]  # fmt: skip
    assert main(argv) == 0
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [d["turn"] for d in lines] == [0, 1, 2]
    assert lines[1]["cached_tokens"]["gpu"] > 0  # the second turn reused the first's KV
    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    )
    for d in lines:
        prompt = torch.tensor([d["prompt_token_ids"]])
        want = reference.generate(
            prompt, max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=2
        )[0, prompt.shape[1] :].tolist()
        assert d["output_token_ids"] == want, f"turn {d['turn']}"
        # the next prompt holds this turn's reply as the assistant's message
    assert "Paris" in lines[0]["output_text"]


def test_stateful_equals_stateless_on_sharegpt(smollm2, smollm2_chat, sharegpt20):
    stateless, _ = run_replay(smollm2, smollm2_chat, sharegpt20, Policy.STATELESS, 16384, 0)
    stateful, built = run_replay(smollm2, smollm2_chat, sharegpt20, Policy.PENSIEVE, 16384, 0)
    assert len(stateless) == len(stateful) >= 40
    assert tokens_by_turn(stateful) == tokens_by_turn(stateless)
    reused = sum(d["cached_tokens"]["gpu"] for d in stateful)
    assert reused > 0 and all(d["cached_tokens"]["gpu"] == 0 for d in stateless)
    assert built.engine.totals.sources.new < sum(d["prompt_tokens"] for d in stateful)


@pytest.mark.parametrize("policy", [Policy.PENSIEVE, Policy.LRU, Policy.GPU_ONLY])
def test_every_cache_path_gives_the_same_tokens(smollm2, smollm2_chat, sharegpt20, policy):
    reference, _ = run_replay(smollm2, smollm2_chat, sharegpt20, Policy.STATELESS, 16384, 0)
    # small tiers: 16 GPU blocks, 24 CPU blocks, 8 conversations at once
    lines, built = run_replay(smollm2, smollm2_chat, sharegpt20, policy, 512, 768, concurrency=8)
    assert tokens_by_turn(lines) == tokens_by_turn(reference)
    cached = [d["cached_tokens"] for d in lines]
    gpu_hits = sum(c["gpu"] > 0 for c in cached)
    partial = sum(c["recomputed"] > 0 and c["gpu"] + c["cpu"] > 0 for c in cached)
    full_drop = sum(c["recomputed"] > 0 and c["gpu"] + c["cpu"] == 0 for c in cached)
    swapped_in = sum(c["cpu"] > 0 for c in cached)
    suspensions = built.engine.scheduler.num_suspensions
    counts = dict(gpu_hit=gpu_hits, partial_recompute=partial, full_drop=full_drop,
                  swap_in=swapped_in, suspensions=suspensions)  # fmt: skip
    print(policy.value, counts)
    assert gpu_hits and (partial or full_drop) and suspensions, counts
    if policy is Policy.GPU_ONLY:
        assert swapped_in == 0 and built.engine.runner.swap.stats.bytes_out == 0
    else:
        assert swapped_in and partial and full_drop, counts
        stats = built.engine.runner.swap.stats
        assert stats.bytes_in > 0 and stats.bytes_out > 0
