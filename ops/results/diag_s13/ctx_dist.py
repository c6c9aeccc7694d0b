"""Record the decode contexts of pure-decode steps in the simulated policy run (pensieve, 16.3).

python3 ops/results/diag_s13/ctx_dist.py ops/results/diag_s13/decode_contexts.json
"""

import json
import sys
from pathlib import Path

from pensieve.ops import sim_policies as sp

seen: list[list[int]] = []
real_launch = sp.SimRunner.launch


def launch(self, plan, feed=None):
    p = plan.pieces
    if p and all(x.end - x.start == 1 for x in p) and self.clock.now > 45 and len(seen) < 400:
        seen.append([x.end for x in p])
    return real_launch(self, plan, feed)


sp.SimRunner.launch = launch
profile = "ops/results/cost_h200_llama2-13b-gqa10.json"
sp.main(["--rates", "pensieve=16.3", "--scale", "1.05", "--duration-s", "60",
         "--cost-profile", profile])  # fmt: skip
steps = seen[::40]
Path(sys.argv[1]).write_text(json.dumps(steps))
flat = sorted(c for s in steps for c in s)
print(f"{len(steps)} steps of {[len(s) for s in steps]} decodes; contexts: mean "
      f"{sum(flat) / len(flat):.0f}, p50 {flat[len(flat) // 2]}, p90 {flat[int(0.9 * len(flat))]}, "
      f"max {flat[-1]}")  # fmt: skip
