"""Simulator: with --oracle, a conversation whose last turn has finished is marked idle since
forever, so either policy evicts it first: the best any eviction order could do if the server
knew which conversations had ended. Without --oracle, sim_policies as it is."""
import sys

from pensieve.actors.engine import Engine
from pensieve.ops import bench_workload, sim_policies

ENDED: list[str] = []
orig_advance = bench_workload._Chat.advance
orig_step = Engine.step


def advance(self, prompt, out):
    orig_advance(self, prompt, out)
    if not self.has_next:
        ENDED.append(self.conv_id)


def step(self):
    while ENDED:
        conv = self.kv.conversations.get(ENDED.pop())
        if conv is not None and not conv.pinned:
            conv.last_active = -1e6
    return orig_step(self)


if "--oracle" in sys.argv:
    sys.argv.remove("--oracle")
    bench_workload._Chat.advance = advance
    Engine.step = step
sys.exit(sim_policies.main())
