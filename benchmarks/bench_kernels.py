"""Kernel benchmarks: the paged attention kernel against torch SDPA (flash) on the same GPU.

All in bf16 on fresh random data, 40 query heads over 10 KV heads, head dim 128, 32-token pages
shuffled through the pool, times as the median of triton.testing.do_bench (L2 flushed between
runs). Rows:

- multi-token: 32 sequences x 8 new tokens over 1k/4k/16k cached tokens. Baseline ("ideal") is
  SDPA flash on contiguous KV; the note also gives gather-to-contiguous + SDPA and 8 one-token
  launches of our kernel. Target: ours <= 0.5x the ideal's time.
- decode: 64 sequences x 1 token at 4k: effective K+V bandwidth. Target >= 3.2 TB/s.
- prefill: 2048 new tokens over 4k cached (seq_len 6144), and prompts of 8k and 32k tokens:
  causal TFLOP/s (only unmasked pairs: 4 * D * Hq * sum of keys attended) against SDPA flash.
  Target >= 0.85x SDPA.
- HBM limit: a large device-to-device copy, bytes read + written.

Usage: python3 -m benchmarks.bench_kernels [--sweep] [--json OUT]   (--sweep also times a grid
of launch shapes); python3 -m benchmarks.bench_kernels --splits (each KV split count of a set of
decode and short multi-token shapes from CUDA graphs, against the count the launch shape picks)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from pensieve.kernels.metadata import AttentionMetadata, build_metadata
from pensieve.kernels.triton_attention import KernelConfig, launch_config, paged_attention_triton

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 40, 10, 128, 32
DTYPE = torch.bfloat16
BYTES = 2
DEVICE = "cuda"


@dataclass
class Problem:
    """One step: equal sub-sequences of query_len new tokens ending at seq_len."""

    query: torch.Tensor  # [B * query_len, Hq, D]
    kv_cache: torch.Tensor  # [num_blocks, 2, PAGE, Hkv, D]
    meta: AttentionMetadata
    batch: int
    query_len: int
    seq_len: int

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(HEAD_DIM)

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [B, seq_len, Hkv, D], gathered out of the pages."""
        tables = self.meta.block_tables.long()  # [B, pages]
        shape = (self.batch, -1, NUM_KV_HEADS, HEAD_DIM)
        k = self.kv_cache[tables, 0].view(shape)[:, : self.seq_len]
        v = self.kv_cache[tables, 1].view(shape)[:, : self.seq_len]
        return k, v


def make_problem(batch: int, query_len: int, seq_len: int, kv_heads: int = NUM_KV_HEADS) -> Problem:
    pages = triton.cdiv(seq_len, PAGE)
    num_blocks = batch * pages + 7
    pool = torch.randperm(num_blocks).tolist()
    tables = [pool[i * pages : (i + 1) * pages] for i in range(batch)]
    shape = (num_blocks, 2, PAGE, kv_heads, HEAD_DIM)
    kv_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    q_heads = kv_heads * NUM_Q_HEADS // NUM_KV_HEADS
    query = torch.randn((batch * query_len, q_heads, HEAD_DIM), device=DEVICE, dtype=DTYPE)
    meta = build_metadata([query_len] * batch, [seq_len] * batch, tables, PAGE, device=DEVICE)
    return Problem(query, kv_cache, meta, batch, query_len, seq_len)


def time_us(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


@functools.cache
def flash_takes_gqa() -> bool:
    """Whether SDPA's flash kernel accepts fewer KV heads than query heads on this torch."""
    q = torch.randn((1, 4, 16, HEAD_DIM), device=DEVICE, dtype=DTYPE)
    kv = torch.randn((1, 1, 16, HEAD_DIM), device=DEVICE, dtype=DTYPE)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, is_causal=True)
    except RuntimeError:
        return False
    return True


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA's flash kernel, causal aligned bottom-right (FA2's is_causal); [B, L, H, D] in/out.

    Flash reads the KV heads as they are (GQA) where it can; otherwise KV is expanded to the
    query heads first, which the caller must do outside the timed region (see flash_inputs).
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    out = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, scale=scale)
    return out[0].transpose(1, 2)


def flash_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, str]:
    if flash_takes_gqa():
        return k, v, "flash GQA-native"
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    return k, v, "flash on KV expanded to 40 heads"


def ours(problem: Problem, config: KernelConfig | None) -> Callable[[], torch.Tensor]:
    p = problem
    return lambda: paged_attention_triton(p.query, p.kv_cache, p.meta, p.scale, config=config)


def sweep(name: str, problem: Problem, configs: list[KernelConfig]) -> tuple[KernelConfig, float]:
    """Time each launch shape, print all, return the fastest."""
    results = []
    for config in configs:
        results.append((time_us(ours(problem, config)), config))
        print(f"  sweep {name}: {results[-1][0]:9.1f} us  {config}", flush=True)
    best_us, best = min(results, key=lambda r: r[0])
    return best, best_us


def split_options(block_m: int, block_n: int, seq_len: int, w: int, s: int) -> list[KernelConfig]:
    out = [KernelConfig(block_m, block_n, w, s)]
    for num_splits in (2, 4, 8):
        split_len = triton.cdiv(triton.cdiv(seq_len, num_splits), block_n) * block_n
        out.append(KernelConfig(block_m, block_n, w, s, split_len))
    return out


def pick(name: str, p: Problem, grid: list[KernelConfig], do_sweep: bool) -> tuple[float, str]:
    if do_sweep:
        best, best_us = sweep(name, p, grid)
        return best_us, f"best {best}"
    return time_us(ours(p, None)), f"{launch_config(p.query, p.kv_cache, p.meta)}"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def bench_multi_token(context: int, do_sweep: bool) -> dict:
    p = make_problem(32, 8, context + 8)
    k, v = p.contiguous_kv()
    q4 = p.query.view(p.batch, p.query_len, NUM_Q_HEADS, HEAD_DIM)
    k, v, backend = flash_inputs(q4, k, v)

    def ideal() -> torch.Tensor:
        return sdpa_flash(q4, k, v, p.scale)

    diff = max_diff(ideal().reshape(p.query.shape), ours(p, None)())
    grid = [
        c for bn in (64, 128) for s in (2, 3, 4) for c in split_options(32, bn, p.seq_len, 4, s)
    ]
    ours_us, config_note = pick(f"multi {context}", p, grid, do_sweep)
    ideal_us = time_us(ideal)

    def gather_sdpa() -> torch.Tensor:
        kg, vg, _ = flash_inputs(q4, *p.contiguous_kv())  # expanding is part of its cost
        return sdpa_flash(q4, kg, vg, p.scale)

    gather_us = time_us(gather_sdpa)
    steps = []
    for i in range(p.query_len):
        seq_lens = [p.seq_len - p.query_len + i + 1] * p.batch
        tables = p.meta.block_tables.tolist()
        meta = build_metadata([1] * p.batch, seq_lens, tables, PAGE, device=DEVICE)
        steps.append((q4[:, i], meta))

    def one_token_at_a_time() -> None:
        for q, meta in steps:
            paged_attention_triton(q, p.kv_cache, meta, p.scale)

    one_us = time_us(one_token_at_a_time)
    kv_bytes = 2 * p.batch * p.seq_len * NUM_KV_HEADS * HEAD_DIM * BYTES
    return {
        "name": f"multi-token 32x8 ctx {context // 1024}k",
        "ours_us": ours_us,
        "baseline_us": ideal_us,
        "ratio": ours_us / ideal_us,
        "metric": f"{kv_bytes / ours_us / 1e6:.2f} TB/s KV",
        "target": "ratio <= 0.5",
        "ok": ours_us <= 0.5 * ideal_us,
        "note": f"gather+SDPA {gather_us:.0f} us, 8x1-token {one_us:.0f} us; "
        f"ideal={backend}; max|ours-flash|={diff:.3g}; {config_note}",
    }


def bench_decode(do_sweep: bool) -> dict:
    p = make_problem(64, 1, 4096)
    k, v = p.contiguous_kv()
    q4 = p.query.view(p.batch, p.query_len, NUM_Q_HEADS, HEAD_DIM)
    k, v, backend = flash_inputs(q4, k, v)

    def ideal() -> torch.Tensor:
        return sdpa_flash(q4, k, v, p.scale)

    diff = max_diff(ideal().reshape(p.query.shape), ours(p, None)())
    grid = [
        c
        for bn in (64, 128)
        for w in (2, 4, 8)
        for s in (2, 4)
        for c in split_options(16, bn, p.seq_len, w, s)
    ]
    ours_us, config_note = pick("decode", p, grid, do_sweep)
    ideal_us = time_us(ideal)
    kv_bytes = 2 * p.batch * p.seq_len * NUM_KV_HEADS * HEAD_DIM * BYTES
    tbps = kv_bytes / ours_us / 1e6
    return {
        "name": "decode 64x1 ctx 4k",
        "ours_us": ours_us,
        "baseline_us": ideal_us,
        "ratio": ours_us / ideal_us,
        "metric": f"{tbps:.2f} TB/s KV (SDPA {kv_bytes / ideal_us / 1e6:.2f})",
        "target": ">= 3.2 TB/s",
        "ok": tbps >= 3.2,
        "note": f"ideal={backend}; max|ours-flash|={diff:.3g}; {config_note}",
    }


def bench_prefill(do_sweep: bool, query_len: int = 2048, seq_len: int = 6144) -> dict:
    p = make_problem(1, query_len, seq_len)
    k, v = p.contiguous_kv()
    q4 = p.query.view(p.batch, p.query_len, NUM_Q_HEADS, HEAD_DIM)
    k, v, backend = flash_inputs(q4, k, v)

    def ideal() -> torch.Tensor:
        return sdpa_flash(q4, k, v, p.scale)

    diff = max_diff(ideal().reshape(p.query.shape), ours(p, None)())
    context = p.seq_len - p.query_len
    keys = sum(context + i + 1 for i in range(p.query_len))
    flops = 4 * HEAD_DIM * NUM_Q_HEADS * keys
    grid = [
        KernelConfig(bm, bn, w, s)
        for bm, bn, w, s in [
            (128, 64, 8, 3),
            (128, 64, 8, 2),
            (128, 128, 8, 2),
            (128, 128, 8, 3),
            (128, 64, 4, 3),
            (128, 32, 4, 3),
            (64, 64, 4, 3),
            (64, 128, 4, 2),
            (256, 64, 8, 2),
            (256, 64, 8, 3),
            (256, 32, 8, 3),
            (256, 128, 8, 2),
            (128, 64, 8, 4),
        ]
    ]
    ours_us, config_note = pick("prefill", p, grid, do_sweep)
    ideal_us = time_us(ideal)
    tflops, sdpa_tflops = flops / ours_us / 1e6, flops / ideal_us / 1e6
    name = f"prefill {query_len} over {context // 1024}k" if context else f"prefill {query_len}"
    return {
        "name": name,
        "ours_us": ours_us,
        "baseline_us": ideal_us,
        "ratio": ours_us / ideal_us,
        "metric": f"{tflops:.0f} TFLOP/s (SDPA {sdpa_tflops:.0f})",
        "target": ">= 0.85x SDPA",
        "ok": tflops >= 0.85 * sdpa_tflops,
        "note": f"ideal={backend}; max|ours-flash|={diff:.3g}; {config_note}",
    }


def bench_copy() -> dict:
    src = torch.randn(1 << 30, device=DEVICE, dtype=DTYPE)  # 2 GiB
    dst = torch.empty_like(src)
    copy_us = time_us(lambda: dst.copy_(src))
    tbps = 2 * src.numel() * BYTES / copy_us / 1e6
    return {
        "name": "HBM limit (d2d copy)",
        "ours_us": copy_us,
        "baseline_us": None,
        "ratio": None,
        "metric": f"{tbps:.2f} TB/s read+write",
        "target": "",
        "ok": True,
        "note": "2 GiB bf16 copy_",
    }


def run_kernel_benchmarks(do_sweep: bool = False) -> list[dict]:
    """Run every row on the current CUDA device and return them (see the module docstring)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel benchmarks need a CUDA GPU")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    benches: list[Callable[[], dict]] = [
        bench_copy,
        lambda: bench_decode(do_sweep),
        *[lambda c=c: bench_multi_token(c, do_sweep) for c in (1024, 4096, 16384)],
        lambda: bench_prefill(do_sweep),
        lambda: bench_prefill(do_sweep, 8192, 8192),
        lambda: bench_prefill(do_sweep, 32768, 32768),
    ]
    rows = []
    for bench in benches:
        rows.append(bench())
        print_table(rows[-1:])
        torch.cuda.empty_cache()
    return rows


# (sequences, query tokens each, context, KV heads): decodes and short multi-token steps of the
# kind a closed loop launches, over all 10 KV heads and over the 5 of one of two ranks
SPLIT_SHAPES = [
    (batch, query_len, context, kv_heads)
    for batch, query_len, context in [
        (1, 1, 4096),
        (8, 1, 4096),
        (40, 1, 1536),
        (64, 1, 4096),
        (32, 8, 1024),
        (1, 512, 2048),
    ]
    for kv_heads in (NUM_KV_HEADS, NUM_KV_HEADS // 2)
]


def graph_time_us(problems: list[Problem], config: KernelConfig | None) -> float:
    """One launch's time, from a CUDA graph of one launch on each of the problems (as a step's
    layers replay them): no host launch cost, and each launch reads KV of its own, so little
    of it comes from L2."""
    calls = [ours(p, config) for p in problems]
    for call in calls:
        call()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_us(graph.replay) / len(calls)


def bench_splits(copies: int = 8) -> list[dict]:
    """Each shape at the KV split count the launch shape picks and at every other count (in
    whole tiles), timed from CUDA graphs: how far the pick is from the fastest."""
    rows = []
    for batch, query_len, context, kv_heads in SPLIT_SHAPES:
        problems = [make_problem(batch, query_len, context, kv_heads) for _ in range(copies)]
        p = problems[0]
        chosen = launch_config(p.query, p.kv_cache, p.meta)
        tile = chosen.block_n
        times = {}
        for count in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            if count > 1 and context // count < tile:
                break
            tiles = triton.cdiv(triton.cdiv(context, count), tile)  # a split, in whole tiles
            config = dataclasses.replace(chosen, kv_split_len=tiles * tile if count > 1 else None)
            used = config.num_splits(context)
            if used not in times:
                times[used] = graph_time_us(problems, config)
        picked = chosen.num_splits(context)
        best = min(times, key=lambda c: times[c])
        picked_us = times[picked] if picked in times else graph_time_us(problems, None)
        row = {
            "shape": f"{batch}x{query_len} ctx {context} kv {kv_heads}",
            "picked": picked,
            "picked_us": picked_us,
            "best": best,
            "best_us": times[best],
            "us_by_splits": times,
        }
        rows.append(row)
        sweep_text = " ".join(f"{c}:{t:.1f}" for c, t in times.items())
        print(
            f"splits {row['shape']:<26} picked {picked:>2} {picked_us:8.1f} us  best "
            f"{best:>2} {times[best]:8.1f} us ({picked_us / times[best]:.2f}x)  "
            f"[{sweep_text}]",
            flush=True,
        )
        del problems, p
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    for r in rows:
        base = "" if r["baseline_us"] is None else f"{r['baseline_us']:9.1f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:5.2f}"
        mark = "ok " if r["ok"] else "MISS"
        print(
            f"{r['name']:<24} ours {r['ours_us']:9.1f} us  base {base:>9} us  ratio {ratio:>5}  "
            f"{r['metric']:<32} {r['target']:<14} {mark}  {r['note']}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch shapes")
    parser.add_argument(
        "--splits", action="store_true", help="only time each KV split count of SPLIT_SHAPES"
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    if args.splits:
        split_rows = bench_splits()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(split_rows, f, indent=1)
        raise SystemExit(0)
    results = run_kernel_benchmarks(args.sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n=== kernel benchmarks (median us) ===")
    print_table(results)
