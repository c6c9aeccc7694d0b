"""Tensor parallelism, end to end: the steady 48-conversation closed loop of bench_gpu's replay48
on 1 rank and on N (and under several cache policies), side by side, output tokens per second
in a window after a warm-up.

Each configuration is an engine stepping its executor ranks over the per-step channel
(ops/ranks_engine.py: a nats-server on loopback, one process per rank), so 1 and N ranks differ
in the split alone; the same ShareGPT pool, the same GPU and CPU tiers in tokens, EOS ignored,
output lengths from the recorded replies.

    python3 -m benchmarks.bench_tp_replay [--ranks 1 2] [--json OUT]     (GPUs; .bench assets)
    python3 -m benchmarks.bench_tp_replay --all-reduce nccl peer   (each N > 1 in both modes)
    python3 -m benchmarks.bench_tp_replay --mixed-graphs on off    (steps with prefill pieces
                                                  from graphs cut at attention, and eagerly)
    python3 -m benchmarks.bench_tp_replay --model preset:llama2-70b --ranks 2 \
        --policies pensieve stateless --gpu-tokens 0                     (the paper's model)
    python3 -m benchmarks.bench_tp_replay --smoke                         (CPU, gloo, tiny-llama)
    python3 -m benchmarks.bench_tp_replay --profile 1000,200   (each rank's kernels by kind,
                           host time and all-reduce wait over steps 1000-1199 of each loop)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_workload import ConvSpec, build_workload, steady_closed_loop
from pensieve.actors.config import ALL_REDUCE_ENV, MIXED_GRAPHS_ENV, Policy
from pensieve.actors.executor.kernel_profile import PROFILE_ENV, all_reduce_wait
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.wire.step import StepPlan
from pensieve.models.loader import load_model
from pensieve.models.tensor_parallel import ALL_REDUCE_MODES
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import DTYPES
from pensieve.ops.ranks_engine import ranks_engine
from pensieve.ops.sharegpt import load_conversations

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Settings:
    model: str = "preset:llama2-13b-gqa10"
    device: str = "cuda"
    dtype: str = "bfloat16"
    assets: Path = REPO / ".bench"
    gpu_tokens: int | None = 196608  # bench_gpu's: 40 GB on one 80 GB GPU; None: most free
    cpu_tokens: int = 65536
    pool: int = 300
    concurrency: int = 48
    turns: int = 3
    max_output: int = 512
    max_context: int | None = None
    warmup_s: float = 8.0  # CUDA graphs are captured as new batch sizes come
    window_s: float = 15.0


SMOKE = Settings(
    model="preset:tiny-llama",
    device="cpu",
    dtype="float32",
    gpu_tokens=4096,
    cpu_tokens=4096,
    pool=24,
    concurrency=6,
    turns=2,
    max_output=8,
    max_context=384,
    warmup_s=0.5,
    window_s=2.0,
)


def workload(s: Settings) -> list[ConvSpec]:
    from transformers import AutoTokenizer

    from pensieve.models.assets import smollm2_tokenizer

    folder, path = s.assets / "tokenizer", s.assets / "sharegpt.jsonl"
    tokenizer = (
        AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if folder.is_dir()
        else smollm2_tokenizer()
    )
    config = load_model(s.model, "meta", DTYPES[s.dtype]).config
    context = min(config.max_context_len, s.max_context or config.max_context_len)
    convs = load_conversations(path if path.is_file() else "sharegpt", 400)
    specs = build_workload(convs, tokenizer, config.vocab_size, s.max_output, context, s.turns)
    return specs[: s.pool]


def step_kind(plan: StepPlan) -> str:
    """`decode` (a CUDA graph replays it), `decode+swap-in` or `mixed` (graphs cut at attention
    replay them, or they run eagerly: `--mixed-graphs`)."""
    if any(p.end - p.start != 1 for p in plan.pieces):
        return "mixed"
    return "decode+swap-in" if plan.orders.swap_in else "decode"


def counted_steps(engine: Engine) -> Counter[str]:
    """Counts the engine's launched steps by `step_kind` from here on."""
    kinds: Counter[str] = Counter()
    launch = engine.runner.launch

    def counting(plan: StepPlan, feed: Any = None) -> Any:
        kinds[step_kind(plan)] += 1
        return launch(plan, feed)

    engine.runner.launch = counting  # type: ignore[method-assign]
    return kinds


def closed_loop(
    s: Settings,
    ranks: int,
    policy: Policy,
    specs: list[ConvSpec],
    mode: str = "nccl",
    mixed_graphs: str = "on",
    profile: tuple[int, int] | None = None,
) -> dict[str, Any]:
    os.environ[ALL_REDUCE_ENV] = mode  # the rank processes take both from here
    os.environ[MIXED_GRAPHS_ENV] = "1" if mixed_graphs == "on" else "0"
    tokenizer = s.assets / "tokenizer"
    options = EngineOptions(
        s.model,
        s.device,
        s.dtype,
        tokenizer=str(tokenizer) if tokenizer.is_dir() else None,
        policy=policy,
        gpu_cache_tokens=s.gpu_tokens,
        cpu_cache_tokens=s.cpu_tokens,
        cpu_threads=1 if s.device == "cpu" else None,
        tensor_parallel=ranks,
    )
    begin = time.perf_counter()
    with contextlib.ExitStack() as stack:
        data = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if profile is not None:  # the rank processes take it from the environment
            os.environ[PROFILE_ENV] = f"{data / 'profile'},{profile[0]},{profile[1]}"
            stack.callback(os.environ.pop, PROFILE_ENV, None)
        built = stack.enter_context(ranks_engine(options, data / "store"))
        started = time.perf_counter() - begin
        kinds = counted_steps(built.engine)
        result = steady_closed_loop(built.engine, specs, s.concurrency, s.warmup_s, s.window_s)
        device = built.engine.runner.device_time()
        profiled = None if profile is None else read_profiles(data / "profile", ranks)
    window = result.window.summary()
    # the whole run's steps (warm-up included): what kind they were, and how much of its time
    # the first rank's device waited for the host between steps it could have run back to back
    steps = {
        "kinds": dict(kinds),
        "device_busy_s": device.busy_s,
        "device_idle_s": device.idle_s,
        **result.extra,
    }
    print(
        f"[bench_tp_replay] {s.concurrency} at once, {ranks} rank(s), {policy.value}, {mode}, "
        f"mixed graphs "
        f"{mixed_graphs}: "
        f"{window['tok_per_s']:.0f} tok/s (ranks started in {started:.0f} s); steps "
        f"{dict(kinds)}, device busy {device.busy_s:.1f} s, idle between steps "
        f"{device.idle_s:.1f} s",
        flush=True,
    )
    return {
        "concurrency": s.concurrency,
        "ranks": ranks,
        "policy": policy.value,
        "all_reduce": mode if ranks > 1 else "-",
        "mixed_graphs": mixed_graphs,
        "start_s": started,
        "window": window,
        "turns_finished": len(result.records),
        "steps": steps,
        "profile": profiled,
    }


def read_profiles(folder: Path, ranks: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Every rank's step profile (`rank<r>.json`, written once its last profiled step has
    launched), per step: the host's launch time, the kernels' device time by kind and the
    device's busy time; and the all-reduces split into transfer and each rank's wait."""
    paths = [folder / f"rank{r}.json" for r in range(ranks)]
    deadline = time.monotonic() + timeout_s
    while not all(p.is_file() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.2)
    found = [json.loads(p.read_text()) for p in paths if p.is_file()]
    if len(found) < ranks:
        return {
            "status": f"{len(found)} of {ranks} ranks wrote a profile (did the loop reach "
            "the last profiled step?)"
        }
    first, last = found[0]["steps"]
    count = last - first + 1
    per_rank = []
    for rank in found:
        device = rank["device"]
        per_rank.append(
            {
                "rank": rank["rank"],
                "launch_ms": rank["launch_ms"].get("mean"),
                "result_ms": rank["result_ms"].get("mean"),
                "busy_ms": 1e3 * device.get("busy_s", 0.0) / count,
                "kinds_ms": {k: 1e3 * v / count for k, v in device.get("kinds_s", {}).items()},
                "top_kernels_s": device.get("top_kernels_s", []),
                "status": device.get("status", "ok"),
            }
        )
    reduces = all_reduce_wait([rank["device"].get("all_reduce_us", []) for rank in found])
    if reduces["calls"]:
        reduces["transfer_ms_per_step"] = 1e3 * reduces["transfer_s"] / count
        reduces["wait_ms_per_step"] = [1e3 * w / count for w in reduces["wait_s"]]
    return {"steps": [first, last], "ranks": per_rank, "all_reduce": reduces}


def print_profiles(results: list[dict[str, Any]]) -> None:
    """Per step, each rank's host launch time, device busy time, kernel kinds and all-reduce
    wait."""
    for r in results:
        profile = r.get("profile")
        if not profile:
            continue
        head = (
            f"{r['concurrency']} conversations, {r['ranks']} rank(s), {r['policy']}, "
            f"{r['all_reduce']}"
        )
        if "ranks" not in profile:
            print(f"profile of {head}: {profile['status']}")
            continue
        first, last = profile["steps"]
        print(f"\nprofile of {head}, steps {first}-{last}, ms per step:")
        reduces = profile["all_reduce"]
        for i, rank in enumerate(profile["ranks"]):
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in rank["kinds_ms"].items())
            wait = (
                f"; all-reduce transfer {reduces['transfer_ms_per_step']:.2f}, "
                f"wait {reduces['wait_ms_per_step'][i]:.2f}"
                if reduces["calls"]
                else ""
            )
            launch = rank["launch_ms"] or 0.0
            print(
                f"  rank {rank['rank']}: launch (host) {launch:.2f}, device busy "
                f"{rank['busy_ms']:.2f} ({kinds}){wait}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--policies", nargs="+", default=["pensieve"], choices=[p.value for p in Policy]
    )
    parser.add_argument("--model", default=Settings.model)
    parser.add_argument(
        "--gpu-tokens",
        type=int,
        default=Settings.gpu_tokens,
        help="GPU tier per engine; 0: most of the free memory",
    )
    parser.add_argument(
        "--all-reduce",
        nargs="+",
        default=["nccl"],
        choices=ALL_REDUCE_MODES,
        help="each configuration of several ranks once in each mode",
    )
    parser.add_argument(
        "--mixed-graphs",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="each configuration with steps that prefill replayed from graphs "
        "cut at attention (on), run eagerly (off), or both",
    )
    parser.add_argument(
        "--profile",
        type=parse_profile,
        metavar="FIRST,COUNT",
        help="profile every rank over steps FIRST to FIRST+COUNT-1 of each closed loop",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="conversations at once; each configuration runs once at each",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny-llama, toy sizes")
    args = parser.parse_args(argv)
    base_settings = (
        SMOKE if args.smoke else Settings(model=args.model, gpu_tokens=args.gpu_tokens or None)
    )
    levels = args.concurrency or [base_settings.concurrency]
    settings = [dataclasses.replace(base_settings, concurrency=c) for c in levels]
    s = settings[0]
    specs = workload(s)
    print(
        f"[bench_tp_replay] {s.model}: {len(specs)} conversations, {levels} at once",
        flush=True,
    )
    results = [
        closed_loop(level, ranks, Policy(policy), specs, mode, mixed, args.profile)
        for level in settings
        for ranks in args.ranks
        for mode in (args.all_reduce if ranks > 1 else ["nccl"])
        for mixed in args.mixed_graphs
        for policy in args.policies
    ]
    if args.json is not None:
        args.json.write_text(
            json.dumps({"settings": asdict(s), "results": results}, indent=1, default=str)
        )
    print(f"\nclosed loop, {s.model} {s.dtype}")
    print(
        f"{'convs':>5} {'ranks':>5} {'reduce':>6} {'graphs':>6} {'policy':>9} {'tok/s':>9} "
        f"{'x first':>8} {'turns':>6} {'ms/step':>8} {'mixed':>6} {'busy':>5}"
    )
    for r in results:
        base = next(b for b in results if b["concurrency"] == r["concurrency"])
        base_rate = base["window"]["tok_per_s"]
        rate, steps = r["window"]["tok_per_s"], r["steps"]
        per_step = s.window_s / max(steps["steps_in_window"], 1) * 1e3
        mixed = 1 - steps["kinds"].get("decode", 0) / max(sum(steps["kinds"].values()), 1)
        busy = steps["device_busy_s"] / (s.warmup_s + s.window_s)
        print(
            f"{r['concurrency']:>5} {r['ranks']:>5} {r['all_reduce']:>6} "
            f"{r['mixed_graphs']:>6} {r['policy']:>9} {rate:9.1f} "
            f"{rate / base_rate:8.3f} {r['turns_finished']:>6} {per_step:8.2f} {mixed:6.3f} "
            f"{busy:5.2f}"
        )
    print(
        "graphs: mixed steps from graphs cut at attention (on) or eager (off); ms/step: the "
        "window's mean step; mixed: the share of steps with prefill pieces or swap-ins; busy: "
        "the first rank's device time in steps over the run"
    )
    print_profiles(results)
    return 0


def parse_profile(text: str) -> tuple[int, int]:
    try:
        first, count = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"FIRST,COUNT (step numbers), got {text!r}") from None
    if first < 1 or count < 1:
        raise argparse.ArgumentTypeError("FIRST and COUNT must be >= 1")
    return first, count


if __name__ == "__main__":
    sys.exit(main())
