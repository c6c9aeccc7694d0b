"""The cache policies end to end: throughput of each policy at a p90 normalized-latency bound.

Open loop on ShareGPT: conversations arrive as a Poisson process, each next turn is
sent an exponential think time after the previous reply, replies are the recorded ones (EOS
ignored). Every policy gets the same GPU and CPU budgets, the same model and the same arrivals.

Each point of a sweep runs `duration_s` of arrivals; only turns sent after `warmup_s` count, so
the measured turns come from a system that has filled up: a conversation lives for several turns,
and a short run would see mostly first turns (no history) and flatter every cache.

The sweep looks for the highest arrival rate whose p90 normalized latency stays within the bound:
from a start rate it steps by `rate_factor` up (pass) or down (fail) until a pass sits under a
fail, then tries their geometric mean once. Policies may run in separate processes (one GPU run
each); `combine` merges their result files into one table:

    python3 -m benchmarks.bench_gpu --sections policies --policies pensieve     (GPU, per run)
    python3 -m benchmarks.bench_policies combine a.json b.json ...               (anywhere)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.bench_table import Row, jsonable, print_table
from benchmarks.bench_workload import (
    SLOW_STEP_S,
    ConvSpec,
    History,
    OpenLoop,
    describe_breakdown,
    describe_slow_step,
    open_loop,
    summarize,
)
from pensieve.actors.config import Policy
from pensieve.actors.executor.kernel_profile import ProfileWindow
from pensieve.ops.factory import frozen_heap

if TYPE_CHECKING:
    from benchmarks.bench_gpu import Bench

GB = 1e9
POINT_OVERHEAD_S = 8.0  # a fresh engine, freeing the last one, the summary


def run_point(
    b: Bench, policy: Policy, specs: Sequence[ConvSpec], rate: float, options: OpenLoop
) -> dict[str, Any]:
    """One open-loop run of one policy at one arrival rate, summarized."""
    engine = b.engine(policy, b.s.gpu_tokens, b.s.cpu_tokens)
    window = None
    if b.s.profile_s > 0 and b.cuda and options.warmup_s > 0:
        window = ProfileWindow(options.warmup_s + PROFILE_AFTER_S, b.s.profile_s)
    on_step = window.on_step if window is not None else None
    before = HostSample.now()
    result = open_loop(engine, specs, options, History.GENERATED, on_step=on_step)
    host = HostSample.now().since(before)
    summary = summarize(result.records, options.duration_s - options.warmup_s)
    if window is not None:
        result.extra["kernels"] = window.finish()
    stats = engine.swap_stats()
    summary.update(
        policy=policy.value,
        rate=rate,
        steps=engine.totals.steps,
        unfinished=summary["turns"] - summary["finished"],
        drained=not result.timed_out,
        swapped_in_gb=stats.bytes_in / GB,
        swapped_out_gb=stats.bytes_out / GB,
        passed=summary["norm_latency_p90"] <= b.s.latency_bound,
        host=host,
        **result.extra,  # step times: a stalled step shows as step_ms_max and slow_steps
    )
    b.log(
        f"{policy.value:>9} @ {rate:.2f} conv/s: {describe(summary)}; "
        f"unfinished {summary['unfinished']}, {summary['steps']} steps "
        f"(p50/p99/max {summary['step_ms_p50']:.0f}/{summary['step_ms_p99']:.0f}/"
        f"{summary['step_ms_max']:.0f} ms, {summary['slow_steps']} over {SLOW_STEP_S} s)"
    )
    b.log(f"    steps in the window: {describe_breakdown(summary['step_breakdown'])}")
    pauses = summary["gc"]
    b.log(
        f"    garbage collector: {pauses['seconds']:.2f}s in {sum(pauses['collections'])} "
        f"collections, {pauses['collections'][2]} full (longest {pauses['full_max_ms']:.0f} ms)"
    )
    b.log(
        f"    host: {host['user_s']:.1f} s user + {host['sys_s']:.1f} s system CPU in "
        f"{host['wall_s']:.1f} s, {host['involuntary_switches']} involuntary switches, "
        f"{host['minor_faults']} minor faults, load {host['load_1m']:.1f}, "
        f"cores at {host['cpu_mhz']:.0f} MHz"
    )
    for event in summary["compiles"]:
        b.log(f"    compiled {event['kernel']} at {event['at_s']:.1f}s in {event['ms']:.0f} ms")
    for step in summary["slow"]:
        b.log(f"    slow step at {step['at_s']:.1f}s: {describe_slow_step(step)}")
    if "kernels" in summary:
        b.log(f"    GPU kernels: {describe_kernels(summary['kernels'])}")
    del engine, result
    b.free()
    return summary


@dataclasses.dataclass(frozen=True)
class HostSample:
    """What the benchmark's process and machine were doing, for telling a point whose host ran
    slow (a newly started machine can launch its first points slower) from one whose policy
    cost more: CPU time, faults and preemptions of this process, and the machine's load and
    core clock."""

    wall: float
    usage: resource.struct_rusage

    @classmethod
    def now(cls) -> HostSample:
        return cls(time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF))

    def since(self, before: HostSample) -> dict[str, float]:
        a, b = before.usage, self.usage
        return {
            "wall_s": self.wall - before.wall,
            "user_s": b.ru_utime - a.ru_utime,
            "sys_s": b.ru_stime - a.ru_stime,
            "minor_faults": b.ru_minflt - a.ru_minflt,
            "major_faults": b.ru_majflt - a.ru_majflt,
            "involuntary_switches": b.ru_nivcsw - a.ru_nivcsw,
            "load_1m": os.getloadavg()[0],
            "cpu_mhz": _mean_cpu_mhz(),
        }


def _mean_cpu_mhz() -> float:
    """The cores' mean clock now, from /proc/cpuinfo (0 where it does not say)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return 0.0
    clocks = [float(line.split(":")[1]) for line in lines if line.startswith("cpu MHz")]
    return sum(clocks) / len(clocks) if clocks else 0.0


PROFILE_AFTER_S = 10.0  # the profiled slice starts this long into the measured window


def describe_kernels(k: dict[str, Any]) -> str:
    if "wall_s" not in k:
        return k.get("status", "")
    kinds = ", ".join(f"{kind} {sec:.2f}s" for kind, sec in k["kinds_s"].items())
    return (
        f"{k['wall_s']:.1f}s profiled, GPU busy {k['busy_s']:.2f}s (compute "
        f"{k['compute_busy_s']:.2f}s); {kinds}"
    )


def describe(r: dict[str, Any]) -> str:
    src = r["sources"]
    return (
        f"{r['req_per_s']:.2f} req/s {r['tok_per_s']:.0f} tok/s, norm p50/p90 "
        f"{r['norm_latency_p50']:.3f}/{r['norm_latency_p90']:.3f} s/tok, ttft p50/p90 "
        f"{r['ttft_p50']:.2f}/{r['ttft_p90']:.2f}s, gpu/cpu/recomp/new {src['gpu']}/"
        f"{src['cpu']}/{src['recomputed']}/{src['new']}"
    )


def next_rate(passed: Sequence[float], failed: Sequence[float], factor: float) -> float | None:
    """The next rate to try given the rates that passed and failed so far; None when the
    highest pass sits within sqrt(factor) of the lowest fail above it."""
    low = max(passed, default=None)
    high = min((r for r in failed if low is None or r > low), default=None)
    if low is None:
        return round(min(failed) / factor, 2)
    if high is None:
        return round(low * factor, 2)
    if high / low <= math.sqrt(factor) * 1.001:
        return None
    return round(math.sqrt(low * high), 2)


def sweep(
    run: Callable[[float], dict[str, Any]],
    start: float,
    factor: float,
    max_points: int,
    has_time: Callable[[], bool],
) -> list[dict[str, Any]]:
    """Runs at the rates `next_rate` picks, from `start`, while points and time remain."""
    results: list[dict[str, Any]] = []
    rate: float | None = start
    while rate is not None and len(results) < max_points and has_time():
        results.append(run(rate))
        passed = [r["rate"] for r in results if r["passed"]]
        failed = [r["rate"] for r in results if not r["passed"]]
        rate = next_rate(passed, failed, factor)
    return sorted(results, key=lambda r: r["rate"])


def section(b: Bench, rows: list[Row]) -> dict[str, Any]:
    """The `policies` section of bench_gpu: a sweep per policy in `b.s.policies`."""
    s = b.s
    specs = b.workload(s.policy_max_output, s.policy_max_turns)
    specs = [spec for spec in specs if len(spec.turns) >= s.policy_min_turns]
    b.log(f"policies: {len(specs)} conversations of >= {s.policy_min_turns} turns")
    policies = [Policy(name) for name in s.policies]
    starts = dict(s.start_rates)
    cost = b.cost_model()  # before the KV tiers take the memory its measurement needs
    longest = cost.context_lens[-1]
    rows.append(
        Row(
            f"Cost({longest}) / Cost({cost.chunk_size})",
            cost.cost(longest) * 1e3,
            "ms",
            cost.cost(cost.chunk_size) * 1e3,
            f"Cost({cost.chunk_size})",
            note=f"eviction's chunk cost, {cost.source}",
        )
    )
    b.warm_up()
    begin = time.perf_counter()
    engine = b.engine(policies[0], s.gpu_tokens, s.cpu_tokens)
    graphs = getattr(engine.runner, "graphs", None)  # executor ranks capture their own
    if graphs is not None:
        count = graphs.capture_all(s.max_num_seqs)
        b.log(f"{count} decode graphs captured in {time.perf_counter() - begin:.1f}s")
    del engine
    # Kernel variants of mixed steps compile on first use, and the first run of a process fares
    # worse than later runs of the same policy and rate: a short discarded run at the first
    # point's rate (`warmup_run_s` of arrivals) meets most variants and takes that cost.
    first = dict(s.fixed_rates).get(policies[0].value, (starts[policies[0].value],))[0]
    warm = OpenLoop(first, s.think_s, min(s.warmup_run_s, s.duration_s), 0.0, s.drain_s, s.seed + 1)
    b.log("warm-up run (discarded):")
    run_point(b, policies[0], specs, warm.conv_rate, warm)
    point_s = s.duration_s + s.drain_s + POINT_OVERHEAD_S
    fixed_rates = dict(s.fixed_rates)
    with frozen_heap() if s.gc_freeze else contextlib.nullcontext(0.0) as collect_s:
        if s.gc_freeze:
            b.log(f"start-up heap frozen (a full collection of it took {collect_s:.2f}s)")
        if all(policy.value in fixed_rates for policy in policies):
            runs = alternate(b, policies, fixed_rates, specs, point_s)
        else:
            runs = sweeps(b, policies, fixed_rates, specs, point_s)
    rows += compare(runs, s.latency_bound)
    return {
        "status": "ok",
        "latency_bound_s_per_token": s.latency_bound,
        "cost": cost.to_profile(),
        "runs": runs,
    }


def alternate(
    b: Bench,
    policies: Sequence[Policy],
    fixed_rates: dict[str, tuple[float, ...]],
    specs: Sequence[ConvSpec],
    point_s: float,
) -> dict[str, list[dict[str, Any]]]:
    """Every policy's fixed rates, taken in turn (the i-th rate of each policy, then the
    next), so that a drift over the process (the machine warming, a first run's costs) falls on
    every policy alike rather than on the one that runs first; stops when time runs out."""
    s = b.s
    options = OpenLoop(1.0, s.think_s, s.duration_s, s.warmup_s, s.drain_s, s.seed)
    runs: dict[str, list[dict[str, Any]]] = {policy.value: [] for policy in policies}
    for policy, rate in alternation(policies, fixed_rates):
        if b.remaining() - b.reserved() - 5 < point_s:
            b.log(f"no time left for {policy.value} @ {rate:g} and after")
            break
        point = dataclasses.replace(options, conv_rate=rate)
        runs[policy.value].append(run_point(b, policy, specs, rate, point))
    return {name: sorted(results, key=lambda r: r["rate"]) for name, results in runs.items()}


def alternation(
    policies: Sequence[Policy], fixed_rates: dict[str, tuple[float, ...]]
) -> list[tuple[Policy, float]]:
    """The order `alternate` runs points in: each policy's first rate, then each one's second...

    Rounds run the policies forwards and backwards in turn (A B, B A, A B, ...), so with two
    rates each no policy always runs first after the warm-up run: the first measured point on a
    newly started machine can run slower on the host than later ones, and a pass / fail split
    between two close policies at one rate tends to fall on the one that ran first."""
    longest = max(len(fixed_rates[policy.value]) for policy in policies)
    return [
        (policy, fixed_rates[policy.value][i])
        for i in range(longest)
        for policy in (policies if i % 2 == 0 else policies[::-1])
        if i < len(fixed_rates[policy.value])
    ]


def sweeps(
    b: Bench,
    policies: Sequence[Policy],
    fixed_rates: dict[str, tuple[float, ...]],
    specs: Sequence[ConvSpec],
    point_s: float,
) -> dict[str, list[dict[str, Any]]]:
    """One policy after another: its fixed rates, or a sweep from its start rate, within an
    equal share of the time left."""
    s = b.s
    starts = dict(s.start_rates)
    runs: dict[str, list[dict[str, Any]]] = {}
    for i, policy in enumerate(policies):
        share = (b.remaining() - b.reserved() - 5) / (len(policies) - i)
        deadline = time.perf_counter() + share
        options = OpenLoop(1.0, s.think_s, s.duration_s, s.warmup_s, s.drain_s, s.seed)

        def run(rate: float, policy: Policy = policy, options: OpenLoop = options) -> dict:
            return run_point(b, policy, specs, rate, dataclasses.replace(options, conv_rate=rate))

        def has_time(deadline: float = deadline) -> bool:
            return time.perf_counter() + point_s <= deadline

        fixed = fixed_rates.get(policy.value)
        if fixed:
            runs[policy.value] = sorted(
                (run(rate) for rate in fixed if has_time()), key=lambda r: r["rate"]
            )
        else:
            start = starts[policy.value]
            runs[policy.value] = sweep(run, start, s.rate_factor, s.max_points, has_time)
    return runs


def best_passing(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The run at the highest rate that passed every time it was run (None if none did); of
    repeats at that rate, the one with the lowest throughput."""
    failed = {r["rate"] for r in results if not r["passed"]}
    held = [r for r in results if r["passed"] and r["rate"] not in failed]
    if not held:
        return None
    top = max(r["rate"] for r in held)
    return min((r for r in held if r["rate"] == top), key=lambda r: r["req_per_s"])


def compare(runs: dict[str, list[dict[str, Any]]], bound: float) -> list[Row]:
    """A row per policy (its best passing run) and pensieve against each other policy, by
    throughput at the bound (req/s of that run) and by the highest passing arrival rate."""
    rows: list[Row] = []
    best = {name: best_passing(results) for name, results in runs.items()}
    for name, results in runs.items():
        top = best[name]
        tried = ", ".join(f"{r['rate']:g}{'' if r['passed'] else 'x'}" for r in results)
        note = f"tried {tried} (x: over the bound); "
        note += f"@{top['rate']:g}: {describe(top)}" if top else "none passed"
        value = top["req_per_s"] if top else None
        rows.append(Row(f"policy {name}", value, "req/s", ok=top is not None, note=note))
    ours = best.get("pensieve")
    for other, factor in (("stateless", 1.6), ("lru", 1.0), ("gpu-only", 1.0)):
        theirs = best.get(other)
        if other not in runs or "pensieve" not in runs:
            continue
        for label, key, unit in (
            ("req/s at bound", "req_per_s", "req/s"),
            ("highest rate", "rate", "conv/s"),
        ):
            value = ours[key] if ours else None
            ref = theirs[key] if theirs else None
            ok = (
                value is not None
                and ref is not None
                and (value >= factor * ref if factor > 1 else value > ref)
            )
            target = f">= {factor}x" if factor > 1 else "> 1x"
            rows.append(Row(f"pensieve / {other}, {label}", value, unit, ref, other, target, ok))
    return rows


# ---- combine: one table from the result files of several runs -----------------------------


def combine(paths: Sequence[Path], bound: float | None = None) -> dict[str, Any]:
    """Merge the `policies` runs of several bench.json files into one report; a policy run in
    several processes keeps every point (repeats included). Refuses files from different devices or
    settings. With `bound`, every point is judged again against that p90 normalized latency
    instead of the one it ran under (a point records its p90; an unfinished turn makes it inf)."""
    reports = [_numbers(json.loads(Path(p).read_text())) for p in paths]
    first = reports[0]
    fixed = {k: v for k, v in first["settings"].items() if k not in _PER_CALL}
    runs: dict[str, list[dict[str, Any]]] = {}
    for path, report in zip(paths, reports, strict=True):
        if report["meta"]["device"] != first["meta"]["device"]:
            raise ValueError(
                f"{path}: measured on {report['meta']['device']}, not on {first['meta']['device']}"
            )
        settings = {k: v for k, v in report["settings"].items() if k not in _PER_CALL}
        if settings != fixed:
            diff = sorted(
                k for k in settings.keys() | fixed.keys() if settings.get(k) != fixed.get(k)
            )
            raise ValueError(f"{path}: settings differ from {paths[0]} in {', '.join(diff)}")
        for policy, points in report["sections"]["policies"].get("runs", {}).items():
            runs[policy] = sorted(runs.get(policy, []) + points, key=lambda r: r["rate"])
    if bound is None:
        bound = float(first["settings"]["latency_bound"])
    else:
        for point in (point for points in runs.values() for point in points):
            point["passed"] = point["norm_latency_p90"] <= bound
    rows = compare(runs, bound)
    section = {"status": "ok", "latency_bound_s_per_token": bound, "runs": runs, "seconds": 0.0}
    section["rows"] = [row.to_json() for row in rows]
    return {"meta": first["meta"], "settings": first["settings"], "sections": {"policies": section}}


def _numbers(value: Any) -> Any:
    """`jsonable` writes infinite latencies as the string "inf": read them back as floats."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return math.inf if value == "inf" else value


# may differ between the merged runs: they choose which points run, not how one is measured
_PER_CALL = {
    "policies",
    "start_rates",
    "fixed_rates",
    "time_limit_s",
    "max_points",
    "profile_s",
    "warmup_run_s",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="merge policy sweeps from several bench_gpu runs")
    p.add_argument("command", choices=["combine"])
    p.add_argument("files", nargs="+", type=Path, help="bench.json files of bench_gpu")
    p.add_argument("--json", type=Path, help="write the merged report here")
    p.add_argument("--bound", type=float, help="judge every point at this p90 s/token instead")
    args = p.parse_args(argv)
    try:
        report = combine(args.files, args.bound)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    if args.json is not None:
        args.json.write_text(json.dumps(jsonable(report), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
