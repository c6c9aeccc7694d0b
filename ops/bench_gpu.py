"""Every GPU benchmark in one script (DESIGN.md §6): one run on one GPU, a short table printed last.

Sections (--sections a,b,...; they always run in this order, each bounded in time, and an error
in one is recorded in the table and the next one runs):
  kernels   the kernel GPU tests (pytest -m gpu tests/kernels) and ops/bench_kernels.py's rows
  decode    decode step time at batch 1 and 64 (~4k context) through the ModelRunner, next to the
            time to read the weights + KV once at the copy bandwidth measured in the same run
  swap      SwapEngine bandwidth per direction for 64/256/1024 chunks (contiguous and scattered
            slots) next to one large pinned copy; a step with a pipelined 2k-token swap-in
            against the same step with that history already on the GPU
  policies  open-loop ShareGPT (Poisson conversation arrivals, exponential think time), per cache
            policy under the same GPU/CPU budgets: throughput at a p90 normalized-latency bound
  replay48  closed loop, 48 conversations at once: our engine, then (our model freed) transformers
            continuous batching on a LlamaForCausalLM of the same shapes, same prompts

Model: preset:llama2-13b-gqa10 in bf16 with random weights, EOS ignored, output lengths from the
recorded replies. Assets (tokenizer, ShareGPT subset) come from ops/prepare_bench_assets.py.

    python3 -m pensieve.ops.bench_gpu [--sections kernels,decode,swap,replay48]   (GPU)
    python ops/bench_gpu.py --smoke     (CPU, tiny-llama, toy sizes, < 60 s)

Full results go to $OUT/bench.json (or --json PATH), rewritten after every section.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a file: ops/profile.py would shadow the standard library's profile

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pensieve.actors.config import CacheConfig, Policy, SchedulerConfig
from pensieve.actors.cost_model import CostModel
from pensieve.actors.engine import Engine
from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_cache import CopyOp, SwapOrders
from pensieve.actors.request import SamplingParams
from pensieve.actors.step import SeqPiece, StepPlan
from pensieve.models.loader import LoadedModel, load_model
from pensieve.ops.bench_workload import (
    ConvSpec,
    History,
    OpenLoop,
    build_workload,
    closed_loop,
    hf_closed_loop,
    open_loop,
    summarize,
)
from pensieve.ops.factory import DTYPES, EngineOptions, cache_config
from pensieve.ops.sharegpt import load_conversations

SECTIONS = ("kernels", "decode", "swap", "policies", "replay48")
POLICIES = (Policy.PENSIEVE, Policy.LRU, Policy.GPU_ONLY, Policy.STATELESS)
REPO = Path(__file__).resolve().parents[1]
GB = 1e9


@dataclass(frozen=True)
class Settings:
    smoke: bool = False
    model: str = "preset:llama2-13b-gqa10"
    device: str = "cuda"
    dtype: str = "bfloat16"
    assets: Path = REPO / ".bench"
    time_limit_s: float = 540.0
    source_conversations: int = 400
    repeats: int = 10  # timed repetitions of one step or copy (the median is reported)
    # replay48
    replay_conversations: int = 48
    replay_turns: int = 3
    replay_max_output: int = 512
    hf_time_limit_s: float = 120.0
    # decode
    decode_batches: tuple[int, ...] = (1, 64)
    decode_context: int = 4032
    # swap
    swap_chunks: tuple[int, ...] = (64, 256, 1024)
    swap_step_decodes: int = 32
    swap_step_context: int = 2048
    swap_history: int = 2048
    swap_new_tokens: int = 32
    # policies
    gpu_tokens: int = 24576
    cpu_tokens: int = 98304
    policy_max_output: int = 256
    policy_max_turns: int = 8
    rates: tuple[float, ...] = (0.6, 0.9, 1.35, 2.0, 3.0, 4.5)  # new conversations per second
    start_rate: int = 2  # index of the first rate tried; the sweep walks up or down from it
    window_s: float = 30.0
    warmup_s: float = 8.0
    drain_s: float = 10.0
    think_s: float = 1.5
    latency_bound: float = 0.1  # p90 normalized latency, seconds per output token
    seed: int = 0


SMOKE = Settings(
    smoke=True, model="preset:tiny-llama", device="cpu", dtype="float32", time_limit_s=120.0,
    source_conversations=80, repeats=3, replay_conversations=6, replay_turns=2,
    replay_max_output=8, hf_time_limit_s=30.0, decode_batches=(1, 4), decode_context=256,
    swap_chunks=(4, 16), swap_step_decodes=4, swap_step_context=128, swap_history=128,
    swap_new_tokens=8, gpu_tokens=2048, cpu_tokens=8192, policy_max_output=8,
    policy_max_turns=4, rates=(4.0,), start_rate=0, window_s=2.5, warmup_s=0.5, drain_s=3.0,
    think_s=0.1, latency_bound=10.0,
)  # fmt: skip


class Bench:
    """What the sections share: settings, the clock, one loaded model, tokenizer and workloads."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.device = torch.device(settings.device)
        self.dtype = DTYPES[settings.dtype]
        self.cuda = self.device.type == "cuda"
        self.begin = time.perf_counter()
        self._loaded: LoadedModel | None = None
        self._tokenizer: Any = None
        self._workloads: dict[tuple[int, int], list[ConvSpec]] = {}
        self.warmed = False

    def log(self, message: str) -> None:
        print(f"[bench {time.perf_counter() - self.begin:6.1f}s] {message}", flush=True)

    def remaining(self) -> float:
        return self.s.time_limit_s - (time.perf_counter() - self.begin)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            begin = time.perf_counter()
            self._loaded = load_model(self.s.model, self.device, self.dtype, seed=self.s.seed)
            self.sync()
            self.log(f"loaded {self.s.model} in {time.perf_counter() - begin:.1f}s")
        return self._loaded

    def release_model(self) -> None:
        self._loaded = None
        self.free()

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            folder = self.s.assets / "tokenizer"
            if folder.is_dir():
                self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            else:
                from pensieve.models.assets import smollm2_gguf_path

                gguf = smollm2_gguf_path()  # FileNotFoundError: run ops/prepare_bench_assets.py
                self._tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return self._tokenizer

    def workload(self, max_output: int, max_turns: int) -> list[ConvSpec]:
        key = (max_output, max_turns)
        if key not in self._workloads:
            path = self.s.assets / "sharegpt.jsonl"
            source = str(path) if path.is_file() else "sharegpt"
            convs = load_conversations(source, self.s.source_conversations)
            config = self.loaded().config
            self._workloads[key] = build_workload(
                convs, self.tokenizer(), config.vocab_size, max_output,
                config.max_context_len, max_turns,
            )  # fmt: skip
            specs = self._workloads[key]
            self.log(f"workload: {len(specs)} conversations, {sum(len(c.turns) for c in specs)} "
                     f"turns, {sum(c.num_output for c in specs)} output tokens")  # fmt: skip
        return self._workloads[key]

    def engine(self, policy: Policy, gpu_tokens: int | None, cpu_tokens: int | None) -> Engine:
        """A fresh ModelRunner (new KV tiers) and Engine around the one loaded model."""
        loaded = self.loaded()
        options = EngineOptions(model=self.s.model, device=self.s.device, dtype=self.s.dtype,
                                policy=policy, gpu_cache_tokens=gpu_tokens,
                                cpu_cache_tokens=cpu_tokens)  # fmt: skip
        cache = cache_config(options, loaded.config, self.device, self.dtype)
        runner = ModelRunner(loaded.model, cache, self.device, self.dtype)
        scheduling = SchedulerConfig(
            max_num_batched_tokens=options.max_batch_tokens,
            max_num_seqs=options.max_num_seqs,
            max_model_len=loaded.config.max_context_len,
        )
        c = loaded.config
        cost = CostModel.analytic(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                                  c.head_dim, c.intermediate_size, options.block_size)  # fmt: skip
        return Engine(runner, cache, scheduling, cost.cost, frozenset(c.eos_token_ids))

    def warm_up(self) -> None:
        """Compile the Triton kernels for the launch shapes a run meets, outside any timing."""
        if self.warmed:
            return
        begin = time.perf_counter()
        engine = self.engine(Policy.PENSIEVE, 16384, 0)
        limit = self.loaded().config.max_context_len - 16
        rng = random.Random(0)
        vocab = self.loaded().config.vocab_size
        for i, n in enumerate(n for n in (1, 15, 16, 33, 200, 700, 1500, 3000) if n < limit):
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            engine.add_request(f"warm-{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
            engine.step()
        _run_until_idle(engine, 120.0)
        self.sync()
        del engine
        self.free()
        self.warmed = True
        self.log(f"warm-up done in {time.perf_counter() - begin:.1f}s")


def _run_until_idle(engine: Engine, limit_s: float) -> None:
    deadline = time.perf_counter() + limit_s
    while engine.has_work() and time.perf_counter() < deadline:
        engine.step()


def row(name: str, value: float | None, unit: str = "", reference: float | None = None,
        ref_label: str = "", target: str = "", ok: bool | None = None,
        note: str = "") -> dict[str, Any]:  # fmt: skip
    ratio = value / reference if value is not None and reference else None
    return {"name": name, "value": value, "unit": unit, "reference": reference,
            "ref_label": ref_label, "ratio": ratio, "target": target, "ok": ok, "note": note}  # fmt: skip


def median_time(b: Bench, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of fn(), synchronized before and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        b.sync()
        begin = time.perf_counter()
        fn()
        b.sync()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


# ---- A. kernels ---------------------------------------------------------------------------


def section_kernels(b: Bench, rows: list[dict]) -> dict[str, Any]:
    if not b.cuda:
        return {"status": "skipped (no CUDA)"}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "tests/kernels"]  # fmt: skip
    timeout = max(30.0, min(240.0, b.remaining() - 200))
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        summary = next((line for line in reversed(tail) if " in " in line), tail[-1] if tail else "")
        rows.append(row("kernel GPU tests", None, target="all pass", ok=proc.returncode == 0,
                        note=summary.strip("= ")))  # fmt: skip
        details: dict[str, Any] = {"pytest_rc": proc.returncode, "pytest_tail": tail}
    except subprocess.TimeoutExpired:
        rows.append(row("kernel GPU tests", None, target="all pass", ok=False,
                        note=f"timed out after {timeout:.0f}s"))  # fmt: skip
        details = {"pytest_rc": None}
    b.log(f"kernel tests: {rows[-1]['note']}")
    try:
        from pensieve.ops.bench_kernels import run_kernel_benchmarks

        kernel_rows = run_kernel_benchmarks()
    except Exception as exc:  # the kernel engineer's script: its failure must not stop the rest
        traceback.print_exc()
        rows.append(row("bench_kernels", None, ok=False, note=f"error: {_short(exc)}"))
        return {"status": "partial", **details}
    for r in kernel_rows:
        rows.append(row(r["name"], r["ours_us"], "us", r.get("baseline_us"), "baseline",
                        r.get("target", ""), r.get("ok"), f"{r.get('metric', '')}; "
                        f"{r.get('note', '')}"))  # fmt: skip
    return {"status": "ok", **details, "kernel_rows": kernel_rows}


# ---- C. decode ----------------------------------------------------------------------------


def copy_bandwidth(b: Bench) -> float:
    """Device memory bandwidth: bytes read + written by one large copy per second."""
    numel = (1 << 30) if b.cuda else (1 << 24)
    src = torch.ones(numel, dtype=torch.bfloat16, device=b.device)
    dst = torch.empty_like(src)
    seconds = median_time(b, lambda: dst.copy_(src), b.s.repeats)
    return 2 * src.numel() * src.element_size() / seconds


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: all but the embedding table (only rows of it are
    gathered) unless the LM head shares it."""
    params = dict(model.named_parameters())  # shared tensors appear once
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = next((p for n, p in params.items() if "embed_tokens" in n), None)
    tied = embed is not None and not any("lm_head" in n for n in params)
    return total if embed is None or tied else total - embed.numel() * embed.element_size()


def decode_plan(batch: int, context: int, blocks_per_seq: int, block_size: int) -> StepPlan:
    """`batch` one-token decodes at position `context`, each with its own blocks."""
    pieces = []
    for i in range(batch):
        table = tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        pieces.append(SeqPiece(f"d{i}", (7,), context, context + 1, table,
                               SamplingParams(max_tokens=1, ignore_eos=True)))  # fmt: skip
    return StepPlan(tuple(pieces))


def section_decode(b: Bench, rows: list[dict]) -> dict[str, Any]:
    bandwidth = copy_bandwidth(b)
    rows.append(row("device copy bandwidth", bandwidth / GB, "GB/s",
                    note="one large copy, bytes read + written"))  # fmt: skip
    b.log(f"copy bandwidth {bandwidth / GB:.0f} GB/s")
    loaded = b.loaded()
    config, block_size = loaded.config, 32
    per_token = config.kv_bytes_per_token(b.dtype)
    batch_max, context = max(b.s.decode_batches), b.s.decode_context
    if b.cuda:  # shrink the context if the KV of the largest batch does not fit
        fits = int(torch.cuda.mem_get_info(b.device)[0] * 0.85) // (per_token * batch_max)
        context = min(context, fits - block_size)
    blocks_per_seq = -(-(context + 1) // block_size)
    cache = CacheConfig(block_size, batch_max * blocks_per_seq + 1, 0, Policy.GPU_ONLY)
    runner = ModelRunner(loaded.model, cache, b.device, b.dtype)
    weights = weight_bytes_read(loaded.model)
    details: dict[str, Any] = {"bandwidth_gb_s": bandwidth / GB, "context": context,
                               "weight_bytes": weights, "steps": {}}  # fmt: skip
    for batch in b.s.decode_batches:
        plan = decode_plan(batch, context, blocks_per_seq, block_size)
        seconds = median_time(b, lambda plan=plan: runner.execute(plan), b.s.repeats, warmup=3)
        kv = batch * (context + 1) * per_token
        ideal = (weights + kv) / bandwidth
        rows.append(row(f"decode step b={batch} ctx={context}", seconds * 1e3, "ms", ideal * 1e3,
                        "weights+KV read", note=f"reads {(weights + kv) / GB:.1f} GB; "
                        f"{ideal / seconds:.0%} of copy bandwidth"))  # fmt: skip
        details["steps"][batch] = {"seconds": seconds, "ideal_seconds": ideal, "kv_bytes": kv}
        b.log(f"decode b={batch}: {seconds * 1e3:.2f} ms (read-time bound {ideal * 1e3:.2f} ms)")
    return {"status": "ok", **details}


# ---- D. swap ------------------------------------------------------------------------------


def pinned_peak(b: Bench) -> tuple[float, float]:
    """Bytes/s of one large pinned host -> device copy, and of device -> host."""
    numel = 1 << 30
    host = torch.empty(numel, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(numel, dtype=torch.uint8, device=b.device)
    h2d = median_time(b, lambda: dev.copy_(host, non_blocking=True), b.s.repeats)
    d2h = median_time(b, lambda: host.copy_(dev, non_blocking=True), b.s.repeats)
    return numel / h2d, numel / d2h


def _swap_ops(n: int, scattered: bool, seed: int) -> list[CopyOp]:
    if not scattered:
        return [CopyOp(i, i) for i in range(n)]
    # every other slot, shuffled: no two copies are consecutive on both sides
    rng = random.Random(seed)
    gpu, cpu = list(range(0, 2 * n, 2)), list(range(0, 2 * n, 2))
    rng.shuffle(gpu)
    return [CopyOp(g, c) for g, c in zip(gpu, cpu, strict=True)]


def swap_bandwidth(b: Bench, runner: ModelRunner, orders: SwapOrders) -> float:
    """Bytes/s of the orders through the SwapEngine, timed by its own CUDA events."""
    swap = runner.swap
    before = dataclasses.replace(swap.collect_stats())
    for _ in range(b.s.repeats):
        swap.issue(orders)
        b.sync()
    after = swap.collect_stats()
    moved = after.bytes_in + after.bytes_out - before.bytes_in - before.bytes_out
    seconds = after.seconds_in + after.seconds_out - before.seconds_in - before.seconds_out
    return moved / seconds if seconds > 0 else math.nan


def section_swap(b: Bench, rows: list[dict]) -> dict[str, Any]:
    details: dict[str, Any] = {}
    peak_in = peak_out = None
    if b.cuda:
        peak_in, peak_out = pinned_peak(b)
        details.update(peak_h2d_gb_s=peak_in / GB, peak_d2h_gb_s=peak_out / GB)
        rows.append(row("pinned copy peak H2D", peak_in / GB, "GB/s", note="1 GiB, one copy"))
        rows.append(row("pinned copy peak D2H", peak_out / GB, "GB/s", note="1 GiB, one copy"))
        b.log(f"pinned peak: H2D {peak_in / GB:.1f} GB/s, D2H {peak_out / GB:.1f} GB/s")
    else:
        rows.append(row("pinned copy peak", None, note="skipped (no CUDA)"))
    loaded = b.loaded()
    most = max(b.s.swap_chunks)
    cache = CacheConfig(32, 2 * most + 1, 2 * most, Policy.PENSIEVE)
    runner = ModelRunner(loaded.model, cache, b.device, b.dtype)
    details["bandwidth_gb_s"] = {}
    for n in b.s.swap_chunks:
        for scattered in (False, True):
            ops = _swap_ops(n, scattered, b.s.seed)
            layout = "scattered" if scattered else "contiguous"
            for direction, peak in (("in", peak_in), ("out", peak_out)):
                orders = SwapOrders(swap_in=ops) if direction == "in" else SwapOrders(swap_out=ops)
                gbps = swap_bandwidth(b, runner, orders) / GB
                details["bandwidth_gb_s"][f"{direction} {n} {layout}"] = gbps
                ok = None if peak is None else gbps >= 0.8 * peak / GB
                rows.append(row(f"swap-{direction} {n} chunks {layout}", gbps, "GB/s",
                                None if peak is None else peak / GB, "pinned peak",
                                ">= 0.8x peak", ok))  # fmt: skip
            b.log(f"swap {n} chunks {layout}: {rows[-2]['value']:.1f} in, {rows[-1]['value']:.1f} out GB/s")
    del runner
    b.free()
    details["pipelined_step"] = pipelined_step(b, rows)
    return {"status": "ok", **details}


def pipelined_step(b: Bench, rows: list[dict]) -> dict[str, Any]:
    """One step of decodes plus a returning request: its history on the GPU vs swapped in."""
    s, block_size = b.s, 32
    loaded = b.loaded()
    per_seq = -(-(s.swap_step_context + 1) // block_size)
    history_chunks = s.swap_history // block_size
    returning = -(-(s.swap_history + s.swap_new_tokens) // block_size)
    num_gpu = s.swap_step_decodes * per_seq + returning + 1
    cache = CacheConfig(block_size, num_gpu, history_chunks, Policy.PENSIEVE)
    runner = ModelRunner(loaded.model, cache, b.device, b.dtype)
    decodes = decode_plan(s.swap_step_decodes, s.swap_step_context, per_seq, block_size).pieces
    table = tuple(range(s.swap_step_decodes * per_seq, s.swap_step_decodes * per_seq + returning))
    start = history_chunks * block_size
    new = SeqPiece("ret", tuple(range(5, 5 + s.swap_new_tokens)), start,
                   start + s.swap_new_tokens, table, SamplingParams(max_tokens=1))  # fmt: skip
    swap_in = SwapOrders(swap_in=[CopyOp(table[j], j) for j in range(history_chunks)])
    on_gpu, from_cpu = StepPlan((*decodes, new)), StepPlan((*decodes, new), swap_in)

    def step(plan: StepPlan) -> None:
        runner.execute(plan)
        runner.swap.collect_stats()  # also drains its event list

    gpu_s = median_time(b, lambda: step(on_gpu), b.s.repeats, warmup=3)
    cpu_s = median_time(b, lambda: step(from_cpu), b.s.repeats, warmup=3)
    swap_s = median_time(b, lambda: runner.swap.issue(swap_in), b.s.repeats)
    label = f"{s.swap_step_decodes} decodes@{s.swap_step_context} + {s.swap_new_tokens} new"
    rows.append(row(f"step, {s.swap_history}-tok history on GPU", gpu_s * 1e3, "ms", note=label))
    rows.append(row(f"step, {s.swap_history}-tok history swapped in", cpu_s * 1e3, "ms",
                    gpu_s * 1e3, "history on GPU", "<= 1.1x", cpu_s <= 1.1 * gpu_s,
                    f"pipelined per layer; swap alone {swap_s * 1e3:.2f} ms, serial would be "
                    f"{(gpu_s + swap_s) / gpu_s:.2f}x"))  # fmt: skip
    b.log(f"pipelined swap-in step: {cpu_s * 1e3:.2f} ms vs {gpu_s * 1e3:.2f} ms on GPU")
    return {"gpu_seconds": gpu_s, "swapped_seconds": cpu_s, "swap_alone_seconds": swap_s}


# ---- E. policies --------------------------------------------------------------------------


def run_policy(b: Bench, policy: Policy, specs: list[ConvSpec], rate: float) -> dict[str, Any]:
    s = b.s
    engine = b.engine(policy, s.gpu_tokens, s.cpu_tokens)
    options = OpenLoop(rate, s.think_s, s.window_s, s.warmup_s, s.drain_s, s.seed)
    result = open_loop(engine, specs, options, History.GENERATED)
    summary = summarize(result.records, s.window_s - s.warmup_s)
    stats = engine.runner.swap.collect_stats()
    summary.update(policy=policy.value, rate=rate, steps=engine.totals.steps,
                   unfinished=summary["turns"] - summary["finished"], drained=not result.timed_out,
                   swapped_in_gb=stats.bytes_in / GB, swapped_out_gb=stats.bytes_out / GB,
                   passed=summary["norm_latency_p90"] <= s.latency_bound)  # fmt: skip
    src = summary["sources"]
    b.log(f"{policy.value:>9} @ {rate:.2f} conv/s: {summary['req_per_s']:.2f} req/s "
          f"{summary['tok_per_s']:.0f} tok/s p90 norm {summary['norm_latency_p90']:.3f} s/tok "
          f"ttft p50 {summary['ttft_p50']:.2f}s; gpu/cpu/recomp/new {src['gpu']}/{src['cpu']}/"
          f"{src['recomputed']}/{src['new']}; unfinished {summary['unfinished']}")  # fmt: skip
    del engine, result
    b.free()
    return summary


def sweep(b: Bench, policy: Policy, specs: list[ConvSpec], deadline: float) -> list[dict]:
    """Walk the rate ladder from `start_rate`, up while the bound holds, down while it does
    not, until a passing rate sits under a failing one (or the ladder or the time ends)."""
    results: dict[int, dict] = {}
    index = b.s.start_rate
    while 0 <= index < len(b.s.rates) and index not in results:
        if time.perf_counter() + b.s.window_s + 2 > deadline:
            b.log(f"{policy.value}: out of time after {len(results)} rates")
            break
        results[index] = run_policy(b, policy, specs, b.s.rates[index])
        index += 1 if results[index]["passed"] else -1
    return [results[i] for i in sorted(results)]


def section_policies(b: Bench, rows: list[dict]) -> dict[str, Any]:
    s = b.s
    specs = b.workload(s.policy_max_output, s.policy_max_turns)
    b.warm_up()
    runs: dict[str, list[dict]] = {}
    for i, policy in enumerate(POLICIES):
        share = (b.remaining() - 5) / (len(POLICIES) - i)
        runs[policy.value] = sweep(b, policy, specs, time.perf_counter() + share)
    best = {name: _best(results) for name, results in runs.items()}
    for name, top in best.items():
        rows.append(_policy_row(name, top, runs[name], s.latency_bound))
    ours = best["pensieve"]["req_per_s"] if best["pensieve"] else 0.0
    for other, target in (("stateless", 1.6), ("lru", 1.0), ("gpu-only", 1.0)):
        theirs = best[other]["req_per_s"] if best[other] else 0.0
        ok = ours >= target * theirs if ours > 0 else False
        rows.append(row(f"pensieve / {other} (req/s at bound)", ours or None, "req/s",
                        theirs or None, other, f">= {target}x" if target > 1 else "> 1x", ok))  # fmt: skip
    return {"status": "ok", "latency_bound": s.latency_bound, "runs": runs}


def _best(results: list[dict]) -> dict | None:
    passed = [r for r in results if r["passed"]]
    return max(passed, key=lambda r: r["req_per_s"]) if passed else None


def _policy_row(name: str, top: dict | None, results: list[dict], bound: float) -> dict:
    if top is None:
        tried = ", ".join(f"{r['rate']:g}" for r in results)
        return row(f"policy {name}", None, "req/s", ok=False,
                   note=f"no rate met p90 <= {bound} s/tok (tried {tried} conv/s)")  # fmt: skip
    src = top["sources"]
    capped = top is results[-1]
    note = (f"@{top['rate']:g} conv/s{' (highest tried)' if capped else ''}: "
            f"{top['tok_per_s']:.0f} tok/s, norm p50/p90 {top['norm_latency_p50']:.3f}/"
            f"{top['norm_latency_p90']:.3f} s/tok, ttft p50/p90 {top['ttft_p50']:.2f}/"
            f"{top['ttft_p90']:.2f}s, gpu/cpu/recomp/new {src['gpu']}/{src['cpu']}/"
            f"{src['recomputed']}/{src['new']}")  # fmt: skip
    return row(f"policy {name}", top["req_per_s"], "req/s", note=note)


# ---- B. replay48 --------------------------------------------------------------------------


def section_replay48(b: Bench, rows: list[dict]) -> dict[str, Any]:
    s = b.s
    specs = b.workload(s.replay_max_output, s.replay_turns)[: s.replay_conversations]
    b.warm_up()
    engine = b.engine(Policy.PENSIEVE, None if b.cuda else 16384, 0)
    result = closed_loop(engine, specs, len(specs), History.RECORDED, max(30.0, b.remaining() - 60))
    ours = result.output_tokens() / result.seconds
    config = b.loaded().config
    details: dict[str, Any] = {"conversations": len(specs), "history": "recorded replies",
                               "ours": summarize(result.records, result.seconds)}  # fmt: skip
    b.log(f"ours: {result.output_tokens()} tokens in {result.seconds:.1f}s = {ours:.0f} tok/s")
    rows.append(row(f"ours closed loop {len(specs)} convs", ours, "tok/s",
                    target=">= 3000 tok/s" if b.cuda else "", ok=ours >= 3000 if b.cuda else None,
                    note=f"{len(result.finished())} turns, {result.output_tokens()} tokens"
                    f"{', TIMED OUT' if result.timed_out else ''}"))  # fmt: skip
    del engine, result
    b.release_model()
    hf_limit = min(s.hf_time_limit_s, b.remaining() - 40)
    if hf_limit < 10:
        rows.append(row("transformers CB", None, note="skipped (time limit)"))
        return {"status": "partial", **details}
    hf, extra = run_transformers(b, config, specs, hf_limit)
    hf_tps = hf.output_tokens() / hf.seconds if hf.seconds > 0 else math.nan
    details["hf"] = {**summarize(hf.records, hf.seconds), **extra}
    b.log(f"transformers: {hf.output_tokens()} tokens in {hf.seconds:.1f}s = {hf_tps:.0f} tok/s")
    rows.append(row("transformers CB closed loop", hf_tps, "tok/s",
                    note=f"{len(hf.finished())}/{len(hf.records)} turns{' (time limit)' if hf.timed_out else ''}, "
                    f"attn {extra['attn_implementation']}, transformers {extra['version']}"))  # fmt: skip
    rows.append(row("ours / transformers", ours, "tok/s", hf_tps, "transformers", "> 1x",
                    ours > hf_tps))  # fmt: skip
    return {"status": "ok", **details}


def run_transformers(b: Bench, config: Any, specs: list[ConvSpec], limit_s: float) -> tuple:
    """transformers' continuous batching on a LlamaForCausalLM of our shapes, random weights."""
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation import ContinuousBatchingConfig

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_word_embeddings,
    )  # fmt: skip
    begin = time.perf_counter()
    with torch.device(b.device):
        model = LlamaForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=b.dtype)
    model.eval()
    generation = GenerationConfig(do_sample=False, max_new_tokens=b.s.replay_max_output,
                                  eos_token_id=-1, pad_token_id=0)  # fmt: skip
    # on the GPU the manager sizes its cache from free memory; on the CPU it must be told
    cb = ContinuousBatchingConfig() if b.cuda else ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
    extra = {"version": transformers.__version__,
             "attn_implementation": model.config._attn_implementation}  # fmt: skip
    try:
        manager.warmup()
        manager.start()
        b.log(f"transformers ready in {time.perf_counter() - begin:.1f}s "
              f"(attn {extra['attn_implementation']}); running for at most {limit_s:.0f}s")  # fmt: skip
        result = hf_closed_loop(manager, specs, len(specs), limit_s)
    finally:
        manager.stop(block=True, timeout=30, hard_stop=True)
        manager.destroy()
        del manager, model
        b.free()
    return result, extra


# ---- driver -------------------------------------------------------------------------------

SECTION_FNS: dict[str, Callable[[Bench, list[dict]], dict[str, Any]]] = {
    "kernels": section_kernels,
    "decode": section_decode,
    "swap": section_swap,
    "policies": section_policies,
    "replay48": section_replay48,
}
MIN_SECONDS = {"kernels": 60, "decode": 30, "swap": 30, "policies": 60, "replay48": 60}


def run_section(b: Bench, name: str) -> dict[str, Any]:
    rows: list[dict] = []
    begin = time.perf_counter()
    need = 0 if b.s.smoke else MIN_SECONDS[name]
    if b.remaining() < need:
        result: dict[str, Any] = {"status": "skipped (time limit)"}
    else:
        b.log(f"== {name}")
        try:
            result = SECTION_FNS[name](b, rows)
        except Exception as exc:
            traceback.print_exc()
            result = {"status": "error", "error": _short(exc)}
            rows.append(row("ERROR", None, ok=False, note=_short(exc)))
        b.free()
    result.update(seconds=time.perf_counter() - begin, rows=rows)
    b.log(f"== {name}: {result['status']} in {result['seconds']:.1f}s")
    return result


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def meta(b: Bench) -> dict[str, Any]:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "model": b.s.model, "dtype": b.s.dtype,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    info["device"] = torch.cuda.get_device_name(b.device) if b.cuda else platform.processor() or "cpu"
    return info


def print_table(report: dict[str, Any]) -> None:
    m = report["meta"]
    print(f"\n=== Pensieve benchmarks: {m['device']}, {m['model']} {m['dtype']}, torch "
          f"{m['torch']}, transformers {m['transformers']} ===")  # fmt: skip
    print(f"{'section':<9} {'measurement':<42} {'value':>10} {'unit':<6} {'vs':>10} "
          f"{'ratio':>6}  {'target':<14} ok")  # fmt: skip
    for name, section in report["sections"].items():
        if not section["rows"]:
            print(f"{name:<9} {section['status']}")
        for r in section["rows"]:
            value = "-" if r["value"] is None else f"{r['value']:.4g}"
            ref = "-" if r["reference"] is None else f"{r['reference']:.4g}"
            ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
            ok = {True: "ok", False: "MISS", None: ""}[r["ok"]]
            print(f"{name:<9} {r['name'][:42]:<42} {value:>10} {r['unit']:<6} {ref:>10} "
                  f"{ratio:>6}  {r['target']:<14} {ok}")  # fmt: skip
            if r["value"] is None and r["note"]:
                print(f"{'':<9}   {r['note'][:110]}")


def parse_args(argv: list[str] | None) -> tuple[Settings, list[str], Path | None]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (tiny-llama)")
    p.add_argument("--json", type=Path, help="results file (default $OUT/bench.json)")
    p.add_argument("--assets", type=Path, help="folder from ops/prepare_bench_assets.py")
    p.add_argument("--time-limit", type=float, help="seconds for the whole run")
    p.add_argument("--rates", help="policies: comma-separated conversation arrival rates")
    p.add_argument("--start-rate", type=int, help="policies: index of the first rate tried")
    p.add_argument("--latency-bound", type=float, help="policies: p90 s per output token")
    p.add_argument("--think", type=float, help="policies: mean think time, seconds")
    p.add_argument("--window", type=float, help="policies: seconds of arrivals per run")
    p.add_argument("--gpu-tokens", type=int, help="policies: GPU KV budget in tokens")
    p.add_argument("--cpu-tokens", type=int, help="policies: CPU KV budget in tokens")
    p.add_argument("--hf-time-limit", type=float, help="replay48: seconds for transformers")
    args = p.parse_args(argv)
    settings = SMOKE if args.smoke else Settings()
    overrides = {"assets": args.assets, "time_limit_s": args.time_limit,
                 "start_rate": args.start_rate, "latency_bound": args.latency_bound,
                 "think_s": args.think, "window_s": args.window, "gpu_tokens": args.gpu_tokens,
                 "cpu_tokens": args.cpu_tokens, "hf_time_limit_s": args.hf_time_limit}  # fmt: skip
    if args.rates:
        overrides["rates"] = tuple(float(r) for r in args.rates.split(","))
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    out = args.json or (Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT") else None)
    return settings, sections, out


def main(argv: list[str] | None = None) -> int:
    settings, sections, out = parse_args(argv)
    if settings.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --smoke for the CPU version", file=sys.stderr)
        return 2
    b = Bench(settings)
    report: dict[str, Any] = {"meta": meta(b), "settings": _jsonable(dataclasses.asdict(settings)),
                              "sections": {}}  # fmt: skip
    for name in SECTIONS:
        if name in sections:
            report["sections"][name] = run_section(b, name)
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(_jsonable(report), indent=1))
    print_table(report)
    if out is not None:
        print(f"results: {out}")
    return 1 if any(s["status"] == "error" for s in report["sections"].values()) else 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Path):
        return str(value)
    return value


if __name__ == "__main__":
    sys.exit(main())
