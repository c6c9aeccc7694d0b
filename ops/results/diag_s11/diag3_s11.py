"""Session 11 diagnostic 3: the pipelined steps back to back, alternating, after a pause and
serial, with the host's launch time apart from the whole step."""

import statistics
import time

import torch

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_cache import CopyOp, SwapOrders
from pensieve.actors.request import SamplingParams
from pensieve.actors.step import SeqPiece, StepPlan
from pensieve.ops.bench_gpu import Bench, Settings, decode_plan


def small_step(b, num_decodes, context):
    s, bs = b.s, 32
    per_seq = -(-(context + 1) // bs)
    hist = s.swap_history // bs
    returning = -(-(s.swap_history + s.swap_new_tokens) // bs)
    first = num_decodes * per_seq
    cache = CacheConfig(bs, first + 2 * returning + 1, 2 * hist, Policy.PENSIEVE)
    runner = ModelRunner(b.loaded().model, cache, b.device, b.dtype)
    decodes = decode_plan(num_decodes, context, per_seq, bs).pieces
    sw = runner.swap
    tokens = tuple(range(5, 5 + s.swap_new_tokens))
    start = hist * bs

    def plans(k):  # k-th of two returning sequences, each on its own blocks and slots
        table = tuple(range(first + k * returning, first + (k + 1) * returning))
        new = SeqPiece("back", tokens, start, start + len(tokens), table,
                       SamplingParams(max_tokens=1))
        orders = SwapOrders(swap_in=[CopyOp(table[j], k * hist + j) for j in range(hist)])
        return StepPlan((*decodes, new)), StepPlan((*decodes, new), orders), orders

    (base0, sw0, o0), (base1, sw1, o1) = plans(0), plans(1)

    def run(plan):
        t = time.perf_counter()
        launched = runner.launch(plan)
        t1 = time.perf_counter()
        launched.result()
        sw.collect_stats()
        return (t1 - t) * 1e3, (time.perf_counter() - t) * 1e3

    def loop(name, fns, n=16, pause=0.0):
        for f in fns:
            f()
        launch = [[] for _ in fns]
        total = [[] for _ in fns]
        for i in range(n):
            torch.cuda.synchronize()
            if pause:
                time.sleep(pause)
            a, t = fns[i % len(fns)]()
            launch[i % len(fns)].append(a)
            total[i % len(fns)].append(t)
        for k in range(len(fns)):
            ts = total[k]
            print(f"  {name:30s} #{k} launch {statistics.median(launch[k]):6.2f} total "
                  f"{statistics.median(ts):6.2f} [{min(ts):6.2f}-{max(ts):6.2f}]", flush=True)

    def serial(orders, plan):
        sw.issue(orders)
        sw.wait_all()
        sw._layer_events = None
        return run(plan)

    print(f"--- {num_decodes} decodes@{context} + 32 new over 2048")
    for rnd in range(2):
        loop("base back-to-back", [lambda: run(base0)])
        loop("swapped back-to-back", [lambda: run(sw0)])
        loop("swapped, alternate blocks", [lambda: run(sw0), lambda: run(sw1)])
        loop("swapped, 5 ms pause", [lambda: run(sw0)], pause=0.005)
        loop("base/swapped interleaved", [lambda: run(base0), lambda: run(sw0)])
        loop("serial (copies, then forward)", [lambda: serial(o0, base0)])
    del runner
    b.free()


def main():
    b = Bench(Settings())
    small_step(b, 32, 2048)
    small_step(b, 240, 1024)


if __name__ == "__main__":
    main()
