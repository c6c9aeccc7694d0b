"""Session 11 diagnostic (not part of the package): why the small pipelined swap-in step is slow,
and why scattered swap-outs of 64-256 chunks fall under 0.8 of the pinned peak."""

import os
import statistics
import sys
import time

import numpy as np
import torch

from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_cache import CopyOp, SwapOrders
from pensieve.actors.request import SamplingParams
from pensieve.actors.step import SeqPiece, StepPlan
from pensieve.actors.swap import copy_runs
from pensieve.actors.config import CacheConfig, Policy
from pensieve.ops.bench_gpu import Bench, Settings, decode_plan, swap_ops

OUT = os.environ.get("OUT", "/tmp")
REPS = 20


def ev():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def measure(fn, reps=REPS):
    """(host ms until fn returns, device ms start->end event, wall ms incl. sync) medians"""
    host, dev, wall = [], [], []
    for _ in range(3):
        fn()
        torch.cuda.synchronize()
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = ev()
        fn()
        t1 = time.perf_counter()
        e = ev()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        dev.append(s.elapsed_time(e))
        wall.append((t2 - t0) * 1e3)
    q = lambda xs: f"{statistics.median(xs):7.2f} [{min(xs):6.2f}-{max(xs):6.2f}]"
    return f"host {q(host)}  dev {q(dev)}  wall {q(wall)}", statistics.median(wall)


def small_step(b, num_decodes, context, tag):
    s, bs = b.s, 32
    per_seq = -(-(context + 1) // bs)
    hist = s.swap_history // bs
    returning = -(-(s.swap_history + s.swap_new_tokens) // bs)
    first = num_decodes * per_seq
    cache = CacheConfig(bs, first + returning + 1, hist, Policy.PENSIEVE)
    runner = ModelRunner(b.loaded().model, cache, b.device, b.dtype)
    decodes = decode_plan(num_decodes, context, per_seq, bs).pieces
    table, start = tuple(range(first, first + returning)), hist * bs
    tokens = tuple(range(5, 5 + s.swap_new_tokens))
    new = SeqPiece("back", tokens, start, start + len(tokens), table, SamplingParams(max_tokens=1))
    swap_in = SwapOrders(swap_in=[CopyOp(table[j], j) for j in range(hist)])
    base = StepPlan((*decodes, new))
    swapped = StepPlan((*decodes, new), swap_in)
    sw = runner.swap

    def run(plan):
        runner.execute(plan)
        sw.collect_stats()

    def nowait():  # copies issued, forward does not wait on them
        sw.issue(swap_in)
        sw._layer_events = None
        runner.execute(base)
        sw.collect_stats()

    def serial():
        sw.issue(swap_in)
        sw.wait_all()
        sw._layer_events = None
        runner.execute(base)
        sw.collect_stats()

    def alone():
        sw.issue(swap_in)
        sw.collect_stats()

    print(f"--- {tag}: {num_decodes} decodes@{context} + {len(tokens)} new over {s.swap_history}")
    for rnd in range(2):
        for name, fn in (("base", lambda: run(base)), ("swapped", lambda: run(swapped)),
                         ("nowait", nowait), ("serial", serial), ("copies alone", alone)):
            line, _ = measure(fn)
            print(f"  r{rnd} {name:13s} {line}", flush=True)
    # normal-priority copy stream
    hi = sw.in_stream
    sw.in_stream = torch.cuda.Stream()
    line, _ = measure(lambda: run(swapped))
    print(f"  swapped, normal-priority in-stream {line}", flush=True)
    sw.in_stream = hi
    # batched off: foreach DMA
    batch = sw.batch
    sw.batch = None
    line, _ = measure(lambda: run(swapped))
    print(f"  swapped, foreach DMA (no batch) {line}", flush=True)
    sw.batch = batch
    # profile
    if tag == "small":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run(base)
                torch.cuda.synchronize()
            for _ in range(3):
                run(swapped)
                torch.cuda.synchronize()
        prof.export_chrome_trace(f"{OUT}/trace_small.json")
    del runner
    b.free()


def grouped_copy(batch, layers, table, to_gpu, groups):
    """copy layer groups in separate calls"""
    i = 0
    for g in groups:
        batch.copy(layers[i : i + g], table, to_gpu)
        i += g


def geometric(n):
    out, size = [], 1
    while sum(out) < n:
        out.append(min(size, n - sum(out)))
        size *= 2
    return out


def swapout(b):
    most = 1024
    cache = CacheConfig(32, most + 1, most, Policy.PENSIEVE)
    runner = ModelRunner(b.loaded().model, cache, b.device, b.dtype)
    sw = runner.swap
    batch = sw.batch
    L = len(sw.gpu_caches)
    layers = list(range(L))
    print(f"--- swap-out scattered, {L} layers, block/layer {batch.block_bytes} B")
    stream = torch.cuda.Stream()
    for n in (64, 256, 1024):
        ops = swap_ops(n, True, 0)
        runs = copy_runs(ops)
        table = batch.prepare(runs)
        nbytes = n * batch.block_bytes * L
        for name, groups in (("one call", [L]), ("geometric", geometric(L)),
                             ("per layer", [1] * L), ("fours", [4] * (L // 4))):
            for blocked in (False, True):
                for direction in (False, True):
                    times = []
                    for r in range(8):
                        torch.cuda.synchronize()
                        with torch.cuda.stream(stream):
                            if blocked:
                                torch.cuda._sleep(20_000_000)  # ~10 ms: host submits first
                            s = ev()
                            t0 = time.perf_counter()
                            grouped_copy(batch, layers, table, direction, groups)
                            host = (time.perf_counter() - t0) * 1e3
                            e = ev()
                        torch.cuda.synchronize()
                        if r >= 2:
                            times.append((s.elapsed_time(e), host))
                    d = statistics.median(t for t, _ in times)
                    h = statistics.median(h for _, h in times)
                    print(f"  {n:5d} {'in ' if direction else 'out'} {name:10s} "
                          f"{'blocked' if blocked else 'direct '} dev {d:7.2f} ms "
                          f"{nbytes / d / 1e6:6.1f} GB/s host {h:6.2f} ms", flush=True)
    del runner
    b.free()


def main():
    b = Bench(Settings())
    swapout(b)
    small_step(b, 32, 2048, "small")
    small_step(b, 240, 1024, "busy")


if __name__ == "__main__":
    main()
