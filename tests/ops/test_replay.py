"""End to end through `pensieve replay` on the real SmolLM2-135M-Instruct, fp32 on CPU.

The invariant: a turn's greedy tokens do not depend on where its history came from (GPU hit,
CPU swap-in, recomputation of dropped chunks, full re-prefill). Transformers is the reference.
"""

from __future__ import annotations

import gc
import io
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from pensieve.actors.config import Policy
from pensieve.ops.cli import main
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.replay import ReplayOptions, replay
from pensieve.ops.sharegpt import load_conversations

pytestmark = pytest.mark.slow

CHAT = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"]
SMALL_TIERS = dict(gpu_cache_tokens=512, cpu_cache_tokens=256, admission_reserve=0.0)


def run_replay(
    smollm2,
    chat,
    path: Path,
    policy: Policy,
    concurrency: int = 8,
    data_dir: Path | None = None,
    **tiers,
) -> tuple[list[dict], object]:
    options = EngineOptions(model="smollm2", policy=policy, max_batch_tokens=512, **tiers)
    built = assemble(options, smollm2, chat)
    out = io.BytesIO()
    replay_options = ReplayOptions(max_new_tokens=16, concurrency=concurrency)
    replay(built, load_conversations(path), replay_options, out, data_dir)
    built.engine.kv.check_invariants()
    return [orjson.loads(line) for line in out.getvalue().splitlines()], built


def tokens_by_turn(lines: list[dict]) -> dict[tuple[str, int], list[int]]:
    return {(d["conversation_id"], d["turn"]): d["output_token_ids"] for d in lines}


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    record = {"id": "chat-1", "conversations": [{"from": "human", "value": t} for t in CHAT]}
    path.write_bytes(orjson.dumps(record) + b"\n")
    return path


@pytest.fixture(scope="module")
def three_turns(chat_file) -> list[dict]:
    """The 3-turn chat through the real command line, uninterrupted. Its lines go to stdout
    (`--out -`), which records how many objects were frozen out of garbage collection as each
    finished turn is written: the replay is serving then."""
    argv = [
        "replay",
        str(chat_file),
        "--model",
        "smollm2",
        "--out",
        "-",
        "--max-new-tokens",
        "40",
        "--emit-token-ids",
    ]
    stdout = _FreezeRecordingStdout()
    saved, sys.stdout = sys.stdout, stdout  # type: ignore[assignment]
    try:
        assert main(argv) == 0
    finally:
        sys.stdout = saved
    return [orjson.loads(line) for line in stdout.buffer.getvalue().splitlines()]


class _FreezeRecordingStdout(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.buffer = _FreezeRecordingBytes()


class _FreezeRecordingBytes(io.BytesIO):
    def write(self, data: bytes) -> int:  # type: ignore[override]
        FROZEN_WHILE_SERVING.append(gc.get_freeze_count())
        return super().write(data)


FROZEN_WHILE_SERVING: list[int] = []  # objects frozen as `three_turns` wrote each turn


def test_replay_serves_with_the_start_up_heap_frozen(three_turns):
    """`pensieve replay` runs inside `frozen_heap`: while it serves, the collector skips the
    model and everything built before the first turn (frozen), and it is unfrozen on exit."""
    assert len(FROZEN_WHILE_SERVING) >= len(three_turns) == 3
    assert min(FROZEN_WHILE_SERVING) > 10_000  # the loaded model, tokenizer and engine
    assert gc.get_freeze_count() == 0


@pytest.fixture(scope="module")
def stateless(smollm2, smollm2_chat, sharegpt20) -> list[dict]:
    """The reference: every turn re-prefilled, each step planned after the one before is
    applied; every other run here plans a step while the one before is in flight."""
    lines, _ = run_replay(
        smollm2,
        smollm2_chat,
        sharegpt20,
        Policy.STATELESS,
        gpu_cache_tokens=16384,
        overlap=False,
    )
    return lines


def test_three_turn_chat_matches_transformers(three_turns):
    from transformers import AutoModelForCausalLM

    from pensieve.models.assets import smollm2_gguf_path

    assert [d["turn"] for d in three_turns] == [0, 1, 2]
    assert three_turns[1]["prompt_sources"]["gpu"] > 0  # the second turn reused the first's KV
    assert three_turns[2]["new_prompt_tokens"] < three_turns[2]["prompt_tokens"] / 2
    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    for d in three_turns:
        prompt = torch.tensor([d["prompt_token_ids"]])
        want = reference.generate(
            prompt, max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=2
        )[0, prompt.shape[1] :].tolist()
        assert d["output_token_ids"] == want, f"turn {d['turn']}"
    assert "Paris" in three_turns[0]["output_text"]


def test_restart_continues_from_the_token_log(
    smollm2, smollm2_chat, chat_file, three_turns, tmp_path
):
    data_dir = tmp_path / "db"
    first = tmp_path / "first.jsonl"
    # a process that answers the first turn, commits it to LMDB and exits
    cmd = [
        sys.executable,
        "-m",
        "pensieve.ops.cli",
        "replay",
        str(chat_file),
        "--model",
        "smollm2",
        "--out",
        str(first),
        "--max-new-tokens",
        "40",
        "--max-turns",
        "1",
        "--data-dir",
        str(data_dir),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # a fresh engine on the same store continues with the turns not yet answered
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    out = io.BytesIO()
    replay(built, load_conversations(chat_file), ReplayOptions(max_new_tokens=40), out, data_dir)
    rest = [orjson.loads(line) for line in out.getvalue().splitlines()]
    resumed = [orjson.loads(line) for line in first.read_bytes().splitlines()] + rest
    assert [d["turn"] for d in resumed] == [0, 1, 2]
    assert [d["output_token_ids"] for d in resumed] == [d["output_token_ids"] for d in three_turns]
    history = rest[0]["prompt_sources"]
    assert history["recomputed"] > 0 and history["gpu"] == history["cpu"] == 0


def test_stateful_equals_stateless_on_sharegpt(smollm2, smollm2_chat, sharegpt20, stateless):
    stateful, built = run_replay(
        smollm2, smollm2_chat, sharegpt20, Policy.PENSIEVE, gpu_cache_tokens=16384
    )
    assert len(stateless) == len(stateful) >= 40
    assert tokens_by_turn(stateful) == tokens_by_turn(stateless)
    assert sum(d["prompt_sources"]["gpu"] for d in stateful) > 0
    assert all(d["prompt_sources"]["gpu"] == 0 for d in stateless)
    assert built.engine.totals.sources.new < sum(d["prompt_tokens"] for d in stateful) / 2


@pytest.mark.parametrize("policy", [Policy.PENSIEVE, Policy.LRU, Policy.GPU_ONLY])
def test_every_cache_path_gives_the_same_tokens(
    smollm2, smollm2_chat, sharegpt20, stateless, policy
):
    # 16 GPU blocks and 8 CPU blocks for 20 conversations, 8 at a time
    lines, built = run_replay(smollm2, smollm2_chat, sharegpt20, policy, **SMALL_TIERS)
    assert tokens_by_turn(lines) == tokens_by_turn(stateless)
    cached = [d["prompt_sources"] for d in lines]
    counts = {
        "gpu_hit": sum(c["gpu"] > 0 for c in cached),
        "swap_in": sum(c["cpu"] > 0 for c in cached),
        "partial_recompute": sum(c["recomputed"] > 0 and c["gpu"] + c["cpu"] > 0 for c in cached),
        "full_drop": sum(c["recomputed"] > 0 and c["gpu"] + c["cpu"] == 0 for c in cached),
        "suspensions": built.engine.scheduler.num_suspensions,
    }
    print(policy.value, counts)
    assert counts["gpu_hit"] and counts["full_drop"] and counts["suspensions"], counts
    stats = built.engine.runner.swap.stats
    if policy is Policy.GPU_ONLY:
        assert counts["swap_in"] == 0 and stats.bytes_out == 0
    else:
        assert counts["swap_in"] and counts["partial_recompute"], counts
        assert stats.bytes_in > 0 and stats.bytes_out > 0
    # per turn: every swap-in was for one turn, so they add up to the copy engine's total;
    # swap-outs while a turn ran (suspensions) are part of all swap-outs
    swapped = [d["swapped_bytes"] for d in lines]
    assert sum(s["in"] for s in swapped) == stats.bytes_in
    assert sum(s["out"] for s in swapped) <= stats.bytes_out
    for line in lines:
        # a turn's prompt splits by source, counted once even if the turn was suspended
        assert (
            line["cached_tokens"] + line["prompt_sources"]["recomputed"] + line["new_prompt_tokens"]
            == line["prompt_tokens"]
        ), line
        # a turn whose history came from the CPU tier swapped some of it in; one swaps in
        # otherwise only to resume after a suspension
        swapped_in = line["swapped_bytes"]["in"] > 0
        if line["prompt_sources"]["cpu"] > 0:
            assert swapped_in, line
        if swapped_in:
            assert line["prompt_sources"]["cpu"] > 0 or line["suspensions"] > 0, line


def test_suspension_under_decode_pressure_keeps_tokens(smollm2, smollm2_chat):
    """Two requests that fit when admitted but not when grown: the later one is suspended
    (swapped to the CPU tier, requeued) and still produces the same tokens."""
    from pensieve.actors.wire.step import SamplingParams

    prompts = [smollm2_chat.render([{"role": "user", "content": t}]) for t in CHAT[:2]]
    sampling = SamplingParams(max_tokens=96, ignore_eos=True)
    results = {}
    tight = dict(SMALL_TIERS, gpu_cache_tokens=224)  # 7 blocks: each request grows to 5
    roomy = dict(gpu_cache_tokens=4096, overlap=False)  # suspended with a token in flight: tight
    for name, tiers in (("roomy", roomy), ("tight", tight)):
        built = assemble(EngineOptions(model="smollm2", **tiers), smollm2, smollm2_chat)
        requests = [built.engine.add_request(f"c{i}", p, sampling) for i, p in enumerate(prompts)]
        while built.engine.has_work():
            built.engine.step()
        built.engine.kv.check_invariants()
        results[name] = ([r.output_ids for r in requests], built.engine.scheduler.num_suspensions)
        suspended = [r for r in requests if r.num_suspensions]
        # a suspended request's KV went to the CPU tier and came back for it
        assert all(r.swapped_out_blocks > 0 and r.swapped_in_blocks > 0 for r in suspended)
    assert results["tight"][1] > 0 and results["roomy"][1] == 0
    assert results["tight"][0] == results["roomy"][0]


def test_a_turn_too_big_for_the_gpu_tier_is_reported_at_once(smollm2, smollm2_chat):
    """On an idle engine a turn that can never fit is rejected; the step that rejects it applies
    no tokens (nothing was in flight), and still reports it. (The context limit that the
    factory sets keeps such turns out; an engine with a longer one still reports them.)"""
    from pensieve.actors.config import SchedulerConfig
    from pensieve.actors.scheduler.engine import Engine
    from pensieve.actors.scheduler.request import FinishReason
    from pensieve.actors.wire.step import SamplingParams

    tiers = dict(gpu_cache_tokens=64, cpu_cache_tokens=64, admission_reserve=0.0)
    built = assemble(EngineOptions(model="smollm2", **tiers), smollm2, smollm2_chat)
    assert built.engine.max_model_len == 64  # the default: SmolLM2's 8192, cut to the tier
    with pytest.raises(ValueError, match="leaves no room in a context of 64"):
        built.engine.add_request("c0", list(range(3, 200)), SamplingParams(max_tokens=4))
    engine = Engine(
        built.engine.runner,
        built.engine.cache_config,
        SchedulerConfig(max_model_len=smollm2.config.max_context_len),
        lambda num_tokens: float(num_tokens),
        frozenset(),
    )
    request = engine.add_request("c0", list(range(3, 200)), SamplingParams(max_tokens=4))
    outcome = engine.step()
    assert outcome.finished == [request] and request.finish_reason is FinishReason.ABORT
    assert request.error is not None and request.error.startswith("too_long")
    assert not engine.has_work()


def test_replay_over_two_tensor_parallel_ranks_gives_the_tokens_of_one(sharegpt20, tmp_path):
    """`pensieve replay --tensor-parallel 2` (two gloo ranks on the CPU, each a process) on
    tiers small enough that histories are swapped out, swapped in and dropped."""
    tokens, cached = {}, {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}.jsonl"
        argv = [
            "replay",
            str(sharegpt20),
            "--model",
            "preset:tiny-llama",
            "--out",
            str(out),
            "--num-conversations",
            "6",
            "--max-new-tokens",
            "24",
            "--concurrency",
            "6",
            "--gpu-cache-tokens",
            "384",
            "--cpu-cache-tokens",
            "192",
            "--admission-reserve",
            "0",
            "--cpu-threads",
            "1",
            "--tensor-parallel",
            str(ranks),
        ]
        done = subprocess.run(
            [sys.executable, "-m", "pensieve.ops.cli", *argv],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
        tokens[ranks] = tokens_by_turn(lines)
        cached[ranks] = {
            k: sum(d["prompt_sources"][k] for d in lines) for k in ("cpu", "recomputed")
        }
    assert tokens[2] == tokens[1]
    assert cached[2]["cpu"] and cached[2]["recomputed"], cached
