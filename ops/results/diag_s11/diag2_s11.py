"""Session 11 diagnostic 2: is the host slowed while DMA copies run? Interleaved small steps."""

import statistics
import time

import torch

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_cache import CopyOp, SwapOrders
from pensieve.actors.request import SamplingParams
from pensieve.actors.step import SeqPiece, StepPlan
from pensieve.ops.bench_gpu import Bench, Settings, decode_plan


def py_loop():
    t = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i * i
    return (time.perf_counter() - t) * 1e3


def launch_loop(a):
    t = time.perf_counter()
    for _ in range(300):
        torch.add(a, 1.0, out=a)
    return (time.perf_counter() - t) * 1e3


def host_under_dma():
    host = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    a = torch.zeros(16, device="cuda")
    for name, fn in (("python loop", py_loop), ("300 launches", lambda: launch_loop(a))):
        for mode in ("idle", "h2d", "d2h", "idle"):
            xs = []
            for _ in range(8):
                torch.cuda.synchronize()
                if mode != "idle":
                    with torch.cuda.stream(side):  # 4 GiB: ~75 ms of copying
                        if mode == "h2d":
                            dev.copy_(host, non_blocking=True)
                        else:
                            host.copy_(dev, non_blocking=True)
                    time.sleep(0.002)
                xs.append(fn())
                torch.cuda.synchronize()
            print(f"  {name:13s} {mode:5s} median {statistics.median(xs):6.2f} ms "
                  f"[{min(xs):.2f}-{max(xs):.2f}]", flush=True)
    del host, dev


def small_step(b, num_decodes, context):
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
    sw = runner.swap
    batch = sw.batch

    def run(plan, batched=True):
        sw.batch = batch if batched else None
        runner.execute(plan)
        sw.collect_stats()
        sw.batch = batch

    variants = {
        "base": lambda: run(StepPlan((*decodes, new))),
        "swapped": lambda: run(StepPlan((*decodes, new), swap_in)),
        "swapped foreach": lambda: run(StepPlan((*decodes, new), swap_in), False),
    }
    times = {k: [] for k in variants}
    for k, fn in variants.items():
        for _ in range(3):
            fn()
    for _ in range(30):
        for k, fn in variants.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t) * 1e3)
    base = statistics.median(times["base"])
    print(f"--- {num_decodes} decodes@{context} + 32 new over 2048, interleaved x30")
    for k, xs in times.items():
        m = statistics.median(xs)
        print(f"  {k:16s} median {m:6.2f} ms ({m / base:.2f}x) p10 {sorted(xs)[3]:6.2f} "
              f"p90 {sorted(xs)[26]:6.2f}", flush=True)
    del runner
    b.free()


def main():
    print("--- host work while 4 GiB pinned copies run")
    host_under_dma()
    b = Bench(Settings())
    small_step(b, 32, 2048)
    small_step(b, 240, 1024)


if __name__ == "__main__":
    main()
