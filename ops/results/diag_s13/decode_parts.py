"""Session 13 diagnostic: where the time of a policy run's pure-decode step goes on the GPU.

The policy runs' decode steps (~250 decodes at 657 positions on average) take 21.6-23.2 ms on an
H200 against a floor of ~16 ms. This times such steps with the contexts the simulated policy run
at 16.3 conv/s gives them (`decode_contexts.json`, recorded by the session's `ctx_dist.py`), splits
the time by kernel with torch.profiler, and times the two big parts alone: the attention kernel
over a sweep of launch shapes, and the layers' matrix products.

    python3 ops/results/diag_s13/decode_parts.py [--model preset:llama2-13b-gqa10] [--quick]

`--compare N` times session 12's attention against the current one; it needs that kernel file
beside this script first (not kept in the repository: it is the file as of commit b07ca17):

    git show b07ca17:kernels/triton_attention.py > ops/results/diag_s13/attention_s12.py

(git ignores that file: on the GPU machine, carry it.)
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.executor import ModelRunner
from pensieve.actors.request import SamplingParams
from pensieve.actors.step import SeqPiece, StepPlan
from pensieve.kernels import triton_attention as ta
from pensieve.kernels.metadata import build_metadata
from pensieve.kernels.triton_attention import KernelConfig, launch_config, paged_attention_triton
from pensieve.models.loader import load_model

HERE = Path(__file__).resolve().parent
BLOCK = 32


def events_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def plan_for(contexts: list[int], order: list[int]) -> StepPlan:
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    pieces, at = [], 0
    for i, ctx in enumerate(contexts):
        n = -(-(ctx + 1) // BLOCK)
        table = tuple(order[at : at + n])
        at += n
        pieces.append(SeqPiece(f"d{i}", (7,), ctx, ctx + 1, table, sampling))
    return StepPlan(tuple(pieces))


def category(name: str) -> str:
    n = name.lower()
    if "paged_attention" in n:
        return "attention"
    if "merge_splits" in n:
        return "attention merge"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "gemv", "splitk")):
        return "matmul"
    if any(k in n for k in ("rms_norm", "rope", "silu", "write_kv")):
        return "fused element-wise"
    if "memcpy" in n or "memset" in n:
        return "copies"
    return "other"


def profile_steps(runner: ModelRunner, plans: list[StepPlan]) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for plan in plans:
            runner.execute(plan)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        totals[category(ev.name)] += us / 1e3 / len(plans)
        names[ev.name[:90]] += us / 1e3 / len(plans)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:14]
    for name, ms in top:
        print(f"    {ms:8.3f} ms/step  {name}")
    return dict(totals)


def compare_builds(runner: ModelRunner, plans: list[StepPlan], rounds: int) -> dict[str, list]:
    """Graph steps on session 12's attention (`attention_s12.py`: tiles found by search, the
    grid's fastest axis the tile) in plan order, and on the current one in plan order and
    with the executor's order (longest decodes last): graphs captured for each attention, the
    three timed in alternation."""
    import importlib.util

    from pensieve.actors import executor
    from pensieve.actors.cuda_graphs import DecodeGraphs

    spec = importlib.util.spec_from_file_location("attention_s12", HERE / "attention_s12.py")
    old = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["attention_s12"] = old  # its dataclasses look their module up
    spec.loader.exec_module(old)  # type: ignore[union-attr]
    real_order, real_plan = executor.decodes_first, ta.AttentionPlan
    graphs = {}
    for build, plan_class in (("s12", old.AttentionPlan), ("now", real_plan)):
        ta.AttentionPlan = plan_class
        g = DecodeGraphs(
            runner.model,
            runner.gpu_caches,
            runner.cache.num_gpu_blocks,
            BLOCK,
            runner.config.max_context_len,
            runner.scale,
            runner.impl,
        )
        runner.graphs = g
        executor.decodes_first = lambda plan: plan
        for p in plans:
            runner.execute(p)  # capture
        graphs[build] = g
    ta.AttentionPlan = real_plan
    modes = (
        ("s12 build, plan order", "s12", False),
        ("now, plan order", "now", False),
        ("now, longest decodes last", "now", True),
    )
    times: dict[str, list] = {name: [] for name, _, _ in modes}
    for _ in range(rounds):
        for name, build, ordered in modes:
            runner.graphs = graphs[build]
            executor.decodes_first = real_order if ordered else (lambda plan: plan)
            times[name].append(
                statistics.mean(events_ms(lambda p=p: runner.execute(p), 10) for p in plans)
            )
    executor.decodes_first = real_order
    return times


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="preset:llama2-13b-gqa10")
    parser.add_argument("--gpu-blocks", type=int, default=6144)
    parser.add_argument("--quick", action="store_true", help="a few configs only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--compare", type=int, default=0, help="rounds of s12 vs current attention")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 0
    device, dtype = torch.device("cuda"), torch.bfloat16
    out: dict[str, object] = {"device": torch.cuda.get_device_name()}
    steps_ctx: list[list[int]] = json.loads((HERE / "decode_contexts.json").read_text())
    flat = [c for s in steps_ctx for c in s]
    batch = statistics.mean(len(s) for s in steps_ctx)
    print(
        f"{len(steps_ctx)} recorded decode steps, {batch:.0f}"
        f" decodes, mean context {statistics.mean(flat):.0f}, max {max(flat)}",
        flush=True,
    )

    begin = time.perf_counter()
    loaded = load_model(args.model, device, dtype, seed=0)
    model, cfg = loaded.model, loaded.config
    cache = CacheConfig(BLOCK, args.gpu_blocks, 0, Policy.GPU_ONLY)
    runner = ModelRunner(model, cache, device, dtype)
    for c in runner.gpu_caches:
        c.normal_()
    torch.cuda.synchronize()
    print(f"model and runner in {time.perf_counter() - begin:.1f}s", flush=True)
    rng = random.Random(0)
    order = list(range(args.gpu_blocks))
    rng.shuffle(order)
    plans = [plan_for(ctx, order) for ctx in steps_ctx]
    uniform = [plan_for([657] * len(ctx), order) for ctx in steps_ctx[:3]]

    # A. whole steps: graph replay and eager
    graph_ms = [events_ms(lambda p=p: runner.execute(p), 10) for p in plans]
    uni_ms = [events_ms(lambda p=p: runner.execute(p), 10) for p in uniform]
    graphs, runner.graphs = runner.graphs, None
    eager_ms = [events_ms(lambda p=p: runner.execute(p), 5) for p in plans[:4]]
    runner.graphs = graphs
    out["graph_step_ms"] = graph_ms
    out["graph_step_uniform657_ms"] = uni_ms
    out["eager_step_ms"] = eager_ms
    print(
        f"A. decode step (graph): {statistics.mean(graph_ms):.2f} ms mean over the recorded "
        f"steps ({min(graph_ms):.2f}-{max(graph_ms):.2f}); every context 657: "
        f"{statistics.mean(uni_ms):.2f}; eager {statistics.mean(eager_ms):.2f}",
        flush=True,
    )

    # B. by kernel (graph replays; then eager, in case graph kernels are not traced)
    out["graph_kernels_ms"] = out["eager_kernels_ms"] = {}
    try:
        print("B. kernels per graph step:", flush=True)
        out["graph_kernels_ms"] = profile_steps(runner, plans)
        print("   ", {k: round(v, 3) for k, v in out["graph_kernels_ms"].items()}, flush=True)
        runner.graphs = None
        print("B'. kernels per eager step:", flush=True)
        out["eager_kernels_ms"] = profile_steps(runner, plans[:4])
        print("   ", {k: round(v, 3) for k, v in out["eager_kernels_ms"].items()}, flush=True)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: report and go on
        print(f"B failed: {exc!r}", flush=True)
    runner.graphs = graphs

    # C. the attention kernel alone, one layer, over launch shapes
    kv = runner.gpu_caches[0]
    scale = cfg.attn_scale
    results = []
    for label, ctxs in (("recorded", steps_ctx[0]), ("uniform 657", [657] * len(steps_ctx[0]))):
        p = plan_for(ctxs, order)
        meta = build_metadata(
            [1] * len(ctxs), [c + 1 for c in ctxs], [x.block_table for x in p.pieces], BLOCK, device
        )
        q = torch.randn(len(ctxs), cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        o = torch.empty_like(q)
        kv_bytes = sum(c + 1 for c in ctxs) * cfg.num_kv_heads * cfg.head_dim * 2 * 2
        default = launch_config(q, kv, meta)
        configs = [None]
        ns = (32, 64, 128) if not args.quick else (64,)
        ws = (2, 4, 8) if not args.quick else (4,)
        ss = (2, 3, 4) if not args.quick else (2, 3)
        configs += [KernelConfig(16, n, w, s) for n in ns for w in ws for s in ss]
        configs += [KernelConfig(16, 64, 4, 2, split) for split in (256, 512, 1024)]
        for config in configs:
            try:
                call = functools.partial(
                    paged_attention_triton, q, kv, meta, scale, out=o, config=config
                )
                ms = events_ms(call, 30)
            except Exception as exc:  # noqa: BLE001 - a shape that does not fit
                print(f"    {label} {config}: {type(exc).__name__}", flush=True)
                continue
            name = f"default {default}" if config is None else str(config)
            results.append(
                {"contexts": label, "config": name, "us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9}
            )
            print(
                f"    C. {label:12s} {ms * 1e3:7.1f} us {kv_bytes / ms / 1e9:5.2f} TB/s  {name}",
                flush=True,
            )
    out["attention"] = results

    # D. the matrix products of one layer at the graph's padded batch
    layer = model.model.layers[0] if hasattr(model, "model") else model.layers[0]
    weights = {n: m.weight for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    x_rows = 256
    gemm = {}
    for name, w in weights.items():
        x = torch.randn(x_rows, w.shape[1], dtype=dtype, device=device)
        ms = events_ms(lambda x=x, w=w: F.linear(x, w), 50)
        tflops = 2 * x_rows * w.shape[0] * w.shape[1] / ms / 1e9
        gemm[name] = {"shape": list(w.shape), "us": ms * 1e3, "tflop_s": tflops}
        print(
            f"    D. {name:28s} {list(w.shape)} {ms * 1e3:7.1f} us {tflops:6.1f} TFLOP/s",
            flush=True,
        )
    out["gemm_one_layer"] = gemm
    per_layer = sum(g["us"] for g in gemm.values())
    print(
        f"D. one layer's matrix products {per_layer:.1f} us; x {cfg.num_layers} = "
        f"{per_layer * cfg.num_layers / 1e3:.2f} ms",
        flush=True,
    )
    if args.compare:
        times = compare_builds(runner, plans, args.compare)
        out["tilings_ms"] = times
        for mode, t in times.items():
            print(f"E. {mode}: {statistics.median(t):.3f} ms a step ({t})")
        base = statistics.median(times["s12 build, plan order"])
        for mode, t in times.items():
            print(f"E. s12 / {mode}: {base / statistics.median(t):.3f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    best = min((r for r in results if r["contexts"] == "recorded"), key=lambda r: r["us"])
    dflt = next(r for r in results if r["contexts"] == "recorded" and r["config"].startswith("d"))
    print("\n| part | value |\n|---|---|")
    print(f"| decode step, graph (recorded contexts) | {statistics.mean(graph_ms):.2f} ms |")
    print(f"| decode step, graph (all 657) | {statistics.mean(uni_ms):.2f} ms |")
    for k, v in sorted(out["graph_kernels_ms"].items(), key=lambda kv: -kv[1]):
        print(f"| graph kernels: {k} | {v:.2f} ms |")
    print(f"| attention, one layer, default | {dflt['us']:.1f} us, {dflt['tb_s']:.2f} TB/s |")
    print(
        f"| attention, one layer, best | {best['us']:.1f} us, {best['tb_s']:.2f} TB/s "
        f"({best['config']}) |"
    )
    print(f"| matmuls x layers | {per_layer * cfg.num_layers / 1e3:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
