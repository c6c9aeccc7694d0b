"""The policy benchmark's workload against the real scheduler and cache manager, in simulated time.

No model and no device: a stand-in runner charges each step a device time from a linear model of
the H200 step timings (`StepModel`, fitted to `--sections swap` and the policy runs' step
breakdowns) and samples a fixed token (turns ignore EOS, so lengths are those of the recorded
replies). Everything else is the engine of a real run: the open-loop driver, the scheduler, the
block accounting and its eviction, swap and recompute decisions, one step of overlap.

It answers, in a minute on a CPU, how a change of policy moves the token sources (GPU hits,
swap-ins, recomputation) and roughly where the knee goes. It is a planning aid, not a measurement:
every figure the README reports comes from the GPU.

    python3 -m benchmarks.sim_policies --rates pensieve=14.5,lru=14.5
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.bench_workload import (
    ConvSpec,
    History,
    OpenLoop,
    build_workload,
    describe_breakdown,
    open_loop,
    summarize,
)
from pensieve.actors.config import DEFAULTS, CacheConfig, Policy, SchedulerConfig
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.kv.cost_model import CostModel
from pensieve.actors.wire.step import StepPlan

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StepModel:
    """Device and host milliseconds of one step of preset:llama2-13b-gqa10 on an H200 (bf16).

    Device: a fixed part, the matrix products per token of the step, the KV each query token
    reads, and a charge per swapped-in block (the copy kernel holds SMs beside the forward).
    Host: a graph replay or an eager forward, plus one DMA call per swapped-out block and layer;
    with overlap the host's launch of a step runs while the device runs the step before."""

    fixed_ms: float = 2.5
    per_token_ms: float = 0.032
    per_kv_token_ms: float = 0.048e-3  # 200 KB of K and V per token at 4.2 TB/s
    per_swap_in_block_ms: float = 0.01
    eager_ms: float = 3.0  # a mixed step's extra device time over a graph replay
    host_graph_ms: float = 3.0
    host_eager_ms: float = 12.0
    host_per_copy_ms: float = 0.0004
    layers: int = 40
    scale: float = 1.0  # device time multiplier (calibration)

    def device_ms(self, plan: StepPlan) -> float:
        tokens = plan.num_tokens
        kv = sum(p.end for p in plan.pieces if p.end - p.start == 1)
        kv += (
            sum(
                (p.end - p.start) * (p.start + p.end) // 2
                for p in plan.pieces
                if p.end - p.start > 1
            )
            // 64
        )
        eager = any(p.end - p.start > 1 for p in plan.pieces) or plan.orders.swap_in
        return self.scale * (
            self.fixed_ms
            + self.per_token_ms * tokens
            + self.per_kv_token_ms * kv
            + self.per_swap_in_block_ms * len(plan.orders.swap_in)
            + (self.eager_ms if eager else 0.0)
        )

    def host_ms(self, plan: StepPlan) -> float:
        eager = any(p.end - p.start > 1 for p in plan.pieces) or plan.orders.swap_in
        copies = self.layers * len(plan.orders.swap_out)
        launch = self.host_eager_ms if eager else self.host_graph_ms
        return launch + self.host_per_copy_ms * copies


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


class _SimSwap:
    def settle(self) -> None:
        pass


class _SimLaunched:
    def __init__(self, plan: StepPlan, done_at: float, clock: SimClock) -> None:
        self.plan = plan
        self.done_at = done_at
        self.clock = clock

    def result(self) -> list[int]:
        self.clock.now = max(self.clock.now, self.done_at)
        return [0 for p in self.plan.pieces if p.sampling is not None]


class SimRunner:
    """Stands in for ModelRunner: the device is a queue that is free again at `device_free`."""

    def __init__(self, clock: SimClock, model: StepModel) -> None:
        self.clock = clock
        self.model = model
        self.device_free = 0.0
        self.swap = _SimSwap()

    def launch(self, plan: StepPlan, feed: object = None) -> _SimLaunched:
        self.clock.now += self.model.host_ms(plan) / 1e3
        if not plan.pieces:
            return _SimLaunched(plan, self.clock.now, self.clock)
        start = max(self.clock.now, self.device_free)
        self.device_free = start + self.model.device_ms(plan) / 1e3
        return _SimLaunched(plan, self.device_free, self.clock)


def workload(
    assets: Path, conversations: int, max_output: int, max_turns: int, min_turns: int
) -> tuple[list[ConvSpec], int]:
    """The policy benchmark's conversations (and the preset's context length)."""
    from transformers import AutoTokenizer

    from pensieve.models.presets import get_preset
    from pensieve.ops.sharegpt import load_conversations

    config = get_preset("llama2-13b-gqa10")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizer")
    convs = load_conversations(assets / "sharegpt.jsonl", conversations)
    specs = build_workload(
        convs, tokenizer, config.vocab_size, max_output, config.max_context_len, max_turns
    )
    return [s for s in specs if len(s.turns) >= min_turns], config.max_context_len


def steeper(cost: CostModel, factor: float) -> CostModel:
    """The same table with attention's growth beyond the shortest context times `factor`: a
    stand-in for a model or workload where attention weighs more in a chunk's cost."""
    if factor == 1.0:
        return cost
    floor = cost.attention_s[0]
    grown = tuple(floor + factor * (t - floor) for t in cost.attention_s)
    return replace(cost, attention_s=grown, source=f"{cost.source}; attention growth x{factor:g}")


def run(
    policy: Policy, rate: float, specs: list[ConvSpec], max_context: int, args: argparse.Namespace
) -> dict[str, Any]:
    clock = SimClock()
    base = StepModel()
    steps = StepModel(scale=args.scale, per_kv_token_ms=base.per_kv_token_ms * args.attention_scale)
    runner = SimRunner(clock, steps)
    block = DEFAULTS.block_size
    cpu_blocks = args.cpu_tokens // block if policy in (Policy.PENSIEVE, Policy.LRU) else 0
    cache = CacheConfig(block, args.gpu_tokens // block, cpu_blocks, policy)
    scheduling = SchedulerConfig(
        DEFAULTS.max_batch_tokens, args.max_num_seqs, max_context, DEFAULTS.admit_batch
    )
    if args.cost_profile is not None:
        cost = CostModel.from_json(args.cost_profile)
    else:
        cost = CostModel.analytic(40, 5120, 40, 10, 128, 13824, block)
    cost = steeper(cost, args.attention_scale)
    engine = Engine(runner, cache, scheduling, cost.cost, frozenset(), clock=clock)  # type: ignore[arg-type]
    options = OpenLoop(rate, args.think_s, args.duration_s, args.warmup_s, args.drain_s, args.seed)
    result = open_loop(engine, specs, options, History.GENERATED, sleep=clock.sleep)
    summary = summarize(result.records, options.duration_s - options.warmup_s)
    summary.update(policy=policy.value, rate=rate, **result.extra)
    summary["passed"] = summary["norm_latency_p90"] <= args.bound
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.sim_policies")
    parser.add_argument("--rates", required=True, help="policy=rate[/rate...],...")
    parser.add_argument("--assets", type=Path, default=REPO / ".bench")
    parser.add_argument("--gpu-tokens", type=int, default=196608)
    parser.add_argument("--cpu-tokens", type=int, default=262144)
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs)
    parser.add_argument("--duration-s", type=float, default=80.0)
    parser.add_argument("--warmup-s", type=float, default=40.0)
    parser.add_argument("--drain-s", type=float, default=10.0)
    parser.add_argument("--think-s", type=float, default=3.0)
    parser.add_argument("--bound", type=float, default=0.1)
    parser.add_argument("--scale", type=float, default=1.0, help="device time multiplier")
    parser.add_argument(
        "--attention-scale",
        type=float,
        default=1.0,
        help="multiply attention's share of step time and of Cost(l) (a steeper cost profile)",
    )
    parser.add_argument("--seed", type=int, default=0, help="arrivals and think times")
    parser.add_argument("--cost-profile", type=Path, help="a `pensieve profile` table")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    specs, max_context = workload(args.assets, 400, 256, 16, 2)
    out = []
    for item in args.rates.split(","):
        name, rates = item.split("=")
        for rate in rates.split("/"):
            s = run(Policy(name), float(rate), specs, max_context, args)
            out.append(s)
            src = s["sources"]
            print(
                f"{name:>9} @ {float(rate):5.2f}: {s['req_per_s']:.2f} req/s, p90 "
                f"{s['norm_latency_p90']:.3f} {'pass' if s['passed'] else 'FAIL'}; gpu "
                f"{src['gpu']} cpu {src['cpu']} recomputed {src['recomputed']} new {src['new']}; "
                f"ttft p50 {s['ttft_p50']:.2f}",
                flush=True,
            )
            print("    " + describe_breakdown(s["step_breakdown"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
