"""Where the host's time goes in launching an eager step (cProfile), small pipelined step."""
import cProfile
import pstats
import time

import torch

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_cache import CopyOp, SwapOrders
from pensieve.actors.request import SamplingParams
from pensieve.actors.step import SeqPiece, StepPlan
from pensieve.ops.bench_gpu import Bench, Settings, decode_plan

b = Bench(Settings())
bs, n, ctx, hist = 32, 32, 2048, 64
per_seq = -(-(ctx + 1) // bs)
first = n * per_seq
runner = ModelRunner(b.loaded().model, CacheConfig(bs, first + 66, hist, Policy.PENSIEVE), b.device, b.dtype)
decodes = decode_plan(n, ctx, per_seq, bs).pieces
table = tuple(range(first, first + 65))
new = SeqPiece("back", tuple(range(5, 37)), 2048, 2080, table, SamplingParams(max_tokens=1))
plans = {"gpu": StepPlan((*decodes, new)),
         "swapped": StepPlan((*decodes, new), SwapOrders(swap_in=[CopyOp(table[j], j) for j in range(hist)]))}
for name, plan in plans.items():
    for _ in range(5):
        runner.launch(plan).result(); runner.swap.collect_stats()
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        t = time.perf_counter(); l = runner.launch(plan); ts.append(time.perf_counter() - t)
        l.result(); runner.swap.collect_stats(); torch.cuda.synchronize()
    print(name, "launch ms", sorted(ts)[10] * 1e3)
    pr = cProfile.Profile()
    for _ in range(10):
        pr.enable(); l = runner.launch(plan); pr.disable()
        l.result(); runner.swap.collect_stats(); torch.cuda.synchronize()
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)
