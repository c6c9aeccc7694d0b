"""The GPU benchmark script end to end at toy sizes on the CPU (`python -m benchmarks.bench_gpu
--smoke`), and the workload builder it shares, on the real SmolLM2 tokenizer and real ShareGPT
conversations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_workload import (
    History,
    OpenLoop,
    TurnRecord,
    Window,
    arrivals,
    build_workload,
    percentile,
    step_times,
)
from pensieve.actors.scheduler.kv.cost_model import CostModel
from pensieve.ops.sharegpt import Conversation, Message, Role

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    command = [sys.executable, "-m", "benchmarks.bench_gpu", "--smoke", "--json", str(out)]
    command += ["--rates", "stateless=8/6"]  # exact rates for one policy, a sweep for the others
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_section_reports_and_the_table_comes_last(smoke) -> None:
    report, stdout = smoke
    sections = report["sections"]
    assert list(sections) == ["kernels", "decode", "swap", "policies", "replay48"]
    for name, section in sections.items():
        assert section["status"] == "ok" or section["status"].startswith("skipped"), name
    assert sections["kernels"]["status"] == "skipped (no CUDA)"
    table = stdout[stdout.rindex("=== Pensieve benchmarks") :]
    assert "[bench" not in table  # no progress line after the table
    for name in ("decode", "swap", "policies", "replay48"):
        assert name in table


def test_decode_and_swap_measure_positive_times(smoke) -> None:
    report, _ = smoke
    decode = report["sections"]["decode"]
    assert set(decode["steps"]) == {"1", "4"}
    assert all(step["seconds"] > 0 and step["kv_bytes"] > 0 for step in decode["steps"].values())
    swap = report["sections"]["swap"]
    assert len(swap["swap_gb_s"]) == 8 and all(v > 0 for v in swap["swap_gb_s"].values())
    step = swap["pipelined_step"]  # timed in alternating pairs, the host's launch apart
    assert step["swapped_seconds"] > 0 and step["pair_ratio"] > 0
    assert 0 < step["launch_seconds"]["swapped"] <= step["swapped_seconds"] * 1.5
    assert swap["pipelined_step_busy"]["swapped_seconds"] > 0  # beside a fuller decode batch
    beside = swap["decode_beside_swap_out"]  # a decode step with and without a swap-out beside
    assert beside["alone_seconds"] > 0 and beside["beside_seconds"] > 0
    mixed = swap["mixed_steps"]
    assert [m["prompt"] for m in mixed] == [0, 20, 64]
    assert all(m["unfused_seconds"] > 0 and m["fused_seconds"] > 0 for m in mixed)


def test_policies_serve_history_from_the_tiers_they_have(smoke) -> None:
    report, _ = smoke
    points = report["sections"]["policies"]["runs"]
    assert [r["rate"] for r in points["stateless"]] == [6.0, 8.0]  # --rates: both, in order
    assert all(len(points[name]) == 1 for name in ("pensieve", "lru", "gpu-only"))  # max_points
    runs = {name: results[0] for name, results in points.items()}
    assert set(runs) == {"pensieve", "lru", "gpu-only", "stateless"}
    for run in runs.values():
        assert run["finished"] > 0 and run["output_tokens"] > 0
    pensieve = runs["pensieve"]["sources"]
    assert pensieve["gpu"] > 0 and pensieve["cpu"] > 0  # the GPU budget is too small for all
    assert runs["gpu-only"]["sources"]["cpu"] == 0 and runs["gpu-only"]["sources"]["recomputed"] > 0
    stateless = runs["stateless"]["sources"]
    assert stateless["gpu"] == stateless["cpu"] == stateless["recomputed"] == 0
    for run in runs.values():  # every point reports its step times (stalls show as slow steps)
        assert 0 < run["step_ms_p50"] <= run["step_ms_p99"] <= run["step_ms_max"]
        assert run["slow_steps"] == len(run["slow"])  # each stall with what the step did
        assert isinstance(run["compiles"], list)  # Triton kernels compiled during the run
        assert len(run["gc"]["collections"]) == 3 and run["gc"]["seconds"] >= 0  # its pauses
        host = run["host"]  # what the process and the machine were doing meanwhile
        assert host["user_s"] > 0 and host["wall_s"] > 0 and host["minor_faults"] >= 0
        assert host["load_1m"] >= 0 and host["cpu_mhz"] >= 0
    for name, run in runs.items():  # and where the window's time went, per kind of step
        b = run["step_breakdown"]
        kinds = {k: v for k, v in b.items() if isinstance(v, dict)}
        assert b["steps"] == sum(v["steps"] for v in kinds.values()) > 0
        assert kinds["decode"]["decodes_mean"] >= 1 and kinds["decode"]["prefill_tokens_mean"] == 0
        assert kinds["decode"]["decode_context_mean"] > 1  # a decode follows its prompt
        phases = sum(b[p] for p in ("schedule_s", "launch_s", "ahead_s", "wait_s", "update_s"))
        assert phases > 0 and b["idle_s"] >= 0
        swapped_in = [k for k in kinds if k.endswith("+in")]
        if name in ("gpu-only", "stateless"):  # no CPU tier: nothing comes back from one
            assert not swapped_in, (name, sorted(kinds))
        if name == "pensieve":  # its turns drew history from the CPU tier (asserted above)
            assert swapped_in, sorted(kinds)


def test_policies_evict_by_a_cost_profile_measured_in_the_run(smoke) -> None:
    report, _ = smoke
    table = report["sections"]["policies"]["cost"]
    model = CostModel.from_profile(table)  # a well-formed `pensieve profile` table
    assert table["source"].startswith("profile of tiny-llama")  # measured, not the estimate
    assert model.context_lens[0] == 32 and model.context_lens[-1] >= 256
    assert model.non_attention_s > 0 and model.attention_s[-1] > 0
    names = [row["name"] for row in report["sections"]["policies"]["rows"]]
    assert f"Cost({model.context_lens[-1]}) / Cost(32)" in names


def test_step_times_count_the_stalls() -> None:
    times = step_times([0.02] * 97 + [0.03, 0.9, 1.2])
    assert times["step_ms_p50"] == pytest.approx(20.0)
    assert times["step_ms_max"] == pytest.approx(1200.0)
    assert times["slow_steps"] == 2 and 20.0 < times["step_ms_p99"] <= 1200.0
    assert step_times([])["slow_steps"] == 0


def test_replay_keeps_its_concurrency_and_measures_a_window(smoke) -> None:
    replay = smoke[0]["sections"]["replay48"]
    k = replay["concurrency"]
    for side in (replay["ours"], replay["hf"]):
        window = side["window"]
        assert window["seconds"] > 0 and window["tokens"] > 0 and window["turns_finished"] > 0
        assert window["tok_per_s"] == pytest.approx(window["tokens"] / window["seconds"])
        assert window["mean_in_flight"] == pytest.approx(k, abs=0.5)  # always k in flight
        assert 0 < window["mean_decoding"] <= k
        assert side["conversations_started"] > k  # finished ones were replaced
        assert not side["errors"]
    assert replay["hf"]["counting"] == "streamed tokens"


def test_ours_and_transformers_process_identical_token_counts(smoke) -> None:
    replay = smoke[0]["sections"]["replay48"]
    ours, hf = (
        {(c, t): (p, o) for c, t, p, o in replay[side]["turn_tokens"]} for side in ("ours", "hf")
    )
    both = ours.keys() & hf.keys()
    assert len(both) > replay["concurrency"]
    assert all(ours[turn] == hf[turn] for turn in both)  # same prompts, same output lengths


# ---- the workload builder --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    folder = REPO / ".bench" / "tokenizer"
    if folder.is_dir():
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    from pensieve.models.assets import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def chat(*texts: str) -> Conversation:
    roles = [Role.HUMAN, Role.GPT] * len(texts)
    return Conversation("c", tuple(Message(r, t) for r, t in zip(roles, texts, strict=False)))


def test_turn_prompts_are_the_chat_template_rendering(tokenizer) -> None:
    texts = ("Hi there!", "Hello, how can I help?", "Name a city.", "Paris.", "Why?", "Because.")
    [spec] = build_workload([chat(*texts)], tokenizer, 10**6, 64, 4096)
    assert len(spec.turns) == 3
    messages: list[dict[str, str]] = []
    history: list[int] = []
    for k, turn in enumerate(spec.turns):
        messages.append({"role": "user", "content": texts[2 * k]})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert history + list(turn.user_ids) == tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(list(turn.reply_ids)) == texts[2 * k + 1]
        messages.append({"role": "assistant", "content": texts[2 * k + 1]})
        history += [*turn.user_ids, *turn.reply_ids]


def test_outputs_are_capped_and_contexts_bounded(tokenizer) -> None:
    long_reply = "word " * 300
    [spec] = build_workload([chat("a", long_reply, "b", long_reply)], tokenizer, 32000, 50, 4096)
    assert [t.num_output for t in spec.turns] == [50, 50]
    assert all(max(t.user_ids + t.reply_ids) < 32000 for t in spec.turns)
    [short] = build_workload([chat("a", long_reply, "b", long_reply)], tokenizer, 32000, 50, 100)
    assert len(short.turns) == 1  # the second turn would not fit in 100 tokens
    assert build_workload([chat("no reply")], tokenizer, 32000, 50, 4096) == []


def test_arrivals_depend_only_on_the_seed(tokenizer) -> None:
    specs = build_workload([chat("a", "b", "c", "d")], tokenizer, 32000, 8, 4096)
    options = OpenLoop(conv_rate=5.0, think_s=1.0, duration_s=20.0, seed=3)
    runs = [arrivals(specs, options, History.GENERATED) for _ in range(2)]
    first, second = ([(t, c.conv_id, c.thinks) for t, c in run] for run in runs)
    assert first == second
    assert 50 < len(first) < 150 and all(t < 20.0 for t, _, _ in first)
    assert len({conv_id for _, conv_id, _ in first}) == len(first)


def test_unfinished_turns_count_as_slowest() -> None:
    done = TurnRecord("c", 0, 1.0, prompt_tokens=5, output_tokens=10, first_token=1.5, finished=3.0)
    lost = TurnRecord("d", 0, 1.0, prompt_tokens=5, output_tokens=10)
    assert done.normalized_latency == pytest.approx(0.2) and done.ttft == pytest.approx(0.5)
    assert percentile([done.latency, lost.latency], 50) == float("inf")
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


def test_the_window_counts_tokens_and_averages_what_is_in_flight() -> None:
    window = Window(begin=1.0, end=3.0)
    window.sent(0.0)
    window.sent(0.5)
    window.generated(0.8, 5, started=1)  # before the window: not counted
    window.generated(1.5, 4, started=0)
    window.generated(2.0, 1, started=1)
    window.done(2.5, decoded=True)
    window.sent(2.5)
    window.generated(3.0, 7, started=1)  # at the end: not counted
    window.at(4.0)
    summary = window.summary()
    assert summary["tokens"] == 5 and summary["turns_finished"] == 1
    assert summary["seconds"] == pytest.approx(2.0) and summary["tok_per_s"] == pytest.approx(2.5)
    assert summary["mean_in_flight"] == pytest.approx(2.0)
    assert summary["mean_decoding"] == pytest.approx((1 * 1.0 + 2 * 0.5 + 1 * 0.5) / 2)


def test_the_policy_engines_evict_by_the_table_measured_in_the_run() -> None:
    import dataclasses

    from benchmarks.bench_gpu import SMOKE, Bench
    from pensieve.actors.config import Policy

    bench = Bench(dataclasses.replace(SMOKE, max_context=128))
    engine = bench.engine(Policy.PENSIEVE, bench.s.gpu_tokens, bench.s.cpu_tokens)
    measured = bench.cost_model()
    assert measured.source.startswith("profile of tiny-llama")
    assert engine.kv.cost == measured.cost  # the eviction's Cost(l) is the measured one
    analytic = Bench(dataclasses.replace(SMOKE, cost="analytic"))
    other = analytic.engine(Policy.LRU, analytic.s.gpu_tokens, analytic.s.cpu_tokens)
    assert other.kv.cost == analytic.cost_model().cost
    assert analytic.cost_model().source.startswith("analytic")
