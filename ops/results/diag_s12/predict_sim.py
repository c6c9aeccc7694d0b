"""Simulator: pensieve's retention value replaced by the probability that the conversation is
still going, from the workload's own table of how many conversations end after turn k (an upper
bound for a table learned from traffic) and the exponential think time.

    python3 predict_sim.py THINK_S MODE [sim_policies options]

MODE `x` ranks by that probability alone, `cost` by Cost(l) times it. lru is left as it is."""
import math
import sys

from pensieve.actors import kv_manager
from pensieve.actors.config import Policy
from pensieve.ops import sim_policies

# share of the conversations alive after turn k that end there (hazard.py's output)
END = {1: 0.0, 2: .26, 3: .19, 4: .40, 5: .36, 6: .43, 7: .35, 8: .54, 9: .36, 10: .14,
       11: .33, 12: .75}
THINK = float(sys.argv.pop(1))
MODE = sys.argv.pop(1)
TURNS: dict[str, int] = {}
M = kv_manager.KVCacheManager
orig_release = M.release
orig_value = M._value


def release(self, conv, now):
    TURNS[conv.conv_id] = TURNS.get(conv.conv_id, 0) + 1
    return orig_release(self, conv, now)


def value(self, conv, index, now):
    if self.config.policy is Policy.LRU:
        return orig_value(self, conv, index, now)
    k = TURNS.get(conv.conv_id, 0)
    q = 1.0 - END.get(k, 1.0) if k else 1.0  # P(another turn | k turns done)
    s = math.exp(-max(now - conv.last_active, 0.0) / THINK)  # P(think time > idle)
    p = q * s / (q * s + 1 - q) if q < 1 else 1.0  # P(still going | k turns, idle)
    context = min((index + 1) * self.config.block_size, max(conv.num_positions, 1))
    scale = self.cost(context) if MODE == "cost" else 1.0
    return scale * p + index * 1e-12  # leading chunks first within a conversation


M.release = release
M._value = value
sys.exit(sim_policies.main())
