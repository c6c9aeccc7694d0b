"""Host time of the eviction ranking, pensieve against lru (session 15, on the CPU).

In the policy calls 29 and 31 pensieve's host spent more of the window launching and scheduling
steps than lru's. This times the part that differs between the two policies: drawing the 30
lowest-valued GPU chunks (about what one step's ahead-of-time swap-out takes) from 300 idle
conversations holding 5,700 of 6,144 GPU blocks, with the H200's cost profile.

    python3 ops/results/diag_s15/rank_cost.py
"""

from __future__ import annotations

import itertools
import random
import time

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.cost_model import CostModel
from pensieve.actors.kv_manager import KVCacheManager


def main() -> None:
    cost = CostModel.from_json("ops/results/cost_h200_llama2-13b-gqa10.json").cost
    for policy in (Policy.PENSIEVE, Policy.LRU):
        rng = random.Random(0)
        manager = KVCacheManager(
            CacheConfig(num_gpu_blocks=6144, num_cpu_blocks=8192, policy=policy), cost
        )
        now = 0.0
        for i in range(300):
            conv = manager.conversation(f"c{i}", now)
            manager.acquire(conv, rng.randint(100, 1100), now)
            manager.release(conv, now)
            now += 0.01
        used = manager.gpu.capacity - manager.num_free_gpu
        rounds = 500
        start = time.perf_counter()
        for _ in range(rounds):
            now += 0.02
            for _ in itertools.islice(manager._gpu_candidates(now), 30):
                pass
        per_draw = (time.perf_counter() - start) / rounds
        print(f"{policy.value:9s} {per_draw * 1e3:.3f} ms per draw of 30 ({used} blocks in use)")


if __name__ == "__main__":
    main()
