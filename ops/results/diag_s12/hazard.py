"""The policy workload's conversations: how many have k turns, and the share of those still
going after turn k that end there (the hazard predict_sim.py ranks by)."""
from collections import Counter
from pathlib import Path

from pensieve.ops.sim_policies import workload

specs, _ = workload(Path(".bench"), 400, 256, 16, 2)
n = Counter(len(s.turns) for s in specs)
print(len(specs), "conversations; turns: count", sorted(n.items()))
alive = len(specs)
for k in range(1, 14):
    ended = n.get(k, 0)
    print(f"after turn {k:2d}: {alive:3d} going, {ended / alive if alive else 0:.2f} end there")
    alive -= ended
