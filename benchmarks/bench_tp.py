"""Tensor parallelism on one host: the decode step of one model on 1 rank and on N, side by side.

Each configuration runs in processes of its own (one per rank, NCCL between them), one after
the other, on the same plan: `batch` one-token decodes at position `context`, each over its own
blocks, through the ModelRunner (eager, and replayed from its CUDA graph). The context is the
largest up to `--context` whose KV fits beside the model on the fewest ranks of the run, so
every configuration decodes the same step. Next to each time: the time to read the rank's
weights and KV once at the device copy rate measured in the same process. With several
`--all-reduce` modes (nccl, peer: PENSIEVE_ALL_REDUCE), every configuration of more than one
rank runs once in each, and the table gives each one all-reduce of the batch's hidden states,
eager and replayed from a CUDA graph.

    python3 -m benchmarks.bench_tp [--model preset:llama2-13b-gqa10] [--ranks 1 2]
        [--all-reduce nccl peer]
    python3 -m benchmarks.bench_tp --smoke      (CPU, gloo, tiny-llama, toy sizes)

Run from the repository root (`benchmarks` is not installed). The table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pensieve.actors.config import ALL_REDUCE_ENV, CacheConfig, Policy
from pensieve.actors.executor.model_runner import Launched, ModelRunner
from pensieve.actors.wire.step import SamplingParams, SeqPiece, StepPlan
from pensieve.models import load_model
from pensieve.models.shard_loader import load_shard
from pensieve.models.tensor_parallel import (  # NCCL_ENV: NVLink multicast stays off
    ALL_REDUCE_MODES,
    NCCL_ENV,
    AllReduce,
    TensorShard,
    reducer,
)
from pensieve.ops.factory import DTYPES

GB = 1e9


@dataclass(frozen=True)
class Settings:
    model: str
    dtype: str
    batch: int
    context: int
    block_size: int
    repeats: int
    device: str  # cuda or cpu
    prompt: int = 256  # the mixed step: the decodes beside a prompt of this many tokens
    profile: bool = False  # the first rank's kernels in both steps, from graphs (torch.profiler)


@dataclass(frozen=True)
class Timing:
    ranks: int
    eager_s: float
    graph_s: float | None  # None: no CUDA graph here (CPU), or its capture failed
    read_bound_s: float  # the rank's weights and KV read once at the copy rate
    copy_gb_s: float
    # one all-reduce of a decode batch's hidden states [batch, hidden]; a step makes two a layer
    allreduce_us: float | None = None
    error: str | None = None
    all_reduce: str = "-"  # how the row-parallel sums went (nccl, peer; gloo on CPUs)
    allreduce_graph_us: float | None = None  # the same all-reduce replayed from a CUDA graph
    # the decodes beside a prompt, eager and from graphs cut at attention (None: no graphs)
    mixed_eager_s: float | None = None
    mixed_graph_s: float | None = None
    # the first rank's device time per step by kernel kind, of each step replayed from graphs
    profiles: dict[str, dict[str, Any]] | None = None
    # steps from graphs launched back to back, as the engine launches them (each one's inputs
    # go up while the one before runs): the decode step, the mixed step
    back_to_back_s: tuple[float, float] | None = None


def decode_plan(batch: int, context: int, blocks_per_seq: int, prompt: int = 0) -> StepPlan:
    """`batch` one-token decodes at position `context`, each over its own blocks, and a prompt
    of `prompt` tokens (if any) over the blocks after theirs."""
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    pieces = [
        SeqPiece(f"d{i}", (7,), context, context + 1, t, sampling) for i, t in enumerate(tables)
    ]
    if prompt:
        table = tuple(range(batch * blocks_per_seq, (batch + 1) * blocks_per_seq))
        pieces.append(SeqPiece("p", tuple(range(5, 5 + prompt)), 0, prompt, table, sampling))
    return StepPlan(tuple(pieces))


def median_time(fn: Callable[[], object], repeats: int, cuda: bool, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_rate(device: torch.device, repeats: int) -> float:
    """Bytes read + written per second by one large copy."""
    cuda = device.type == "cuda"
    src = torch.ones((1 << 30) if cuda else (1 << 22), dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_time(lambda: dst.copy_(src), repeats, cuda)


def time_rank(s: Settings, shard: TensorShard | None, device: torch.device) -> Timing:
    dtype, cuda = DTYPES[s.dtype], device.type == "cuda"
    ranks = 1 if shard is None else shard.world_size
    if shard is None:
        model = load_model(s.model, device, dtype).model
    else:
        model = load_shard(s.model, device, dtype, shard).model
    blocks_per_seq = -(-(s.context + 1) // s.block_size)
    cache = CacheConfig(s.block_size, (s.batch + 1) * blocks_per_seq, 0, Policy.GPU_ONLY)
    runner = ModelRunner(model, cache, device, dtype, shard=shard)
    plan = decode_plan(s.batch, s.context, blocks_per_seq)
    rate = copy_rate(device, s.repeats)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = s.batch * (s.context + 1) * model.config.kv_bytes_per_token(dtype)
    step = functools.partial(runner.execute, plan)
    with runner.eager():
        eager = median_time(step, s.repeats, cuda)
    graph_s, error = None, None
    if runner.graphs is not None:
        try:
            graph_s = median_time(step, s.repeats, cuda)
        except Exception as failure:  # every rank fails alike: the capture is the same
            error = f"CUDA graph: {type(failure).__name__}: {failure}"
    mixed_plan = decode_plan(s.batch, s.context, blocks_per_seq, s.prompt)
    mixed = functools.partial(runner.execute, mixed_plan)
    with runner.eager():
        mixed_eager = median_time(mixed, s.repeats, cuda)
    mixed_graph = median_time(mixed, s.repeats, cuda) if runner.mixed_graphs else None
    back_to_back = None
    if graph_s is not None and runner.mixed_graphs is not None:
        back_to_back = (
            back_to_back_s(functools.partial(runner.launch, plan), s.repeats),
            back_to_back_s(functools.partial(runner.launch, mixed_plan), s.repeats),
        )
    profiles = None
    if s.profile and cuda:  # every rank steps; the first one records
        first = shard is None or shard.rank == 0
        profiles = {
            name: profile_steps(fn, s.repeats, first)
            for name, fn in (("decode", step), ("mixed", mixed))
        }
    reduce_us = graph_us = None
    if shard is not None:
        hidden = torch.zeros((s.batch, model.config.hidden_size), dtype=dtype, device=device)
        reduce = reducer(shard.group)
        reduce_us = median_time(lambda: reduce(hidden), s.repeats, cuda) * 1e6
        if cuda:
            try:
                graph_us = graphed_reduce_s(reduce, hidden, s.repeats) * 1e6
            except Exception as failure:  # every rank fails alike
                error = f"all-reduce graph: {type(failure).__name__}: {failure}"
    return Timing(
        ranks,
        eager,
        graph_s,
        (weights + kv) / rate,
        rate / GB,
        reduce_us,
        error,
        runner.all_reduce or "-",
        graph_us,
        mixed_eager,
        mixed_graph,
        profiles,
        back_to_back,
    )


def back_to_back_s(launch: Callable[[], Launched], repeats: int, warmup: int = 3) -> float:
    """Seconds per step of `repeats` steps launched without waiting for the one before."""
    for _ in range(warmup):
        launch().result()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(repeats):
        last = launch()
    last.result()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) / repeats


def profile_steps(fn: Callable[[], object], repeats: int, record: bool) -> dict[str, Any]:
    """Milliseconds per step of `repeats` steps: wall, the GPU's busy time and each kernel
    kind's device time (empty where not `record`)."""
    from pensieve.actors.executor.kernel_profile import ProfileWindow

    window = ProfileWindow(0.0, math.inf)
    torch.cuda.synchronize()
    if record:
        window.on_step(0.0)
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    if not record:
        return {}
    summary = window.finish()
    if "wall_s" not in summary:
        return summary
    per_step = 1e3 / repeats
    return {
        "wall_ms": summary["wall_s"] * per_step,
        "busy_ms": summary["busy_s"] * per_step,
        "kinds_ms": {k: v * per_step for k, v in summary["kinds_s"].items()},
    }


def graphed_reduce_s(reduce: AllReduce, hidden: torch.Tensor, repeats: int, n: int = 20) -> float:
    """Seconds of one all-reduce of `hidden` among `n` captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        for _ in range(3):
            reduce(hidden)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            reduce(hidden)
    return median_time(graph.replay, repeats, True) / n


def rank_main(rank: int, world_size: int, s: Settings, store: str, out: str, mode: str) -> None:
    os.environ.update(NCCL_ENV)
    os.environ[ALL_REDUCE_ENV] = mode
    device = torch.device(f"cuda:{rank}" if s.device == "cuda" else "cpu")
    shard = None
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=world_size
        )
        dist.barrier()  # the communicators exist before a graph is captured
        shard = TensorShard(rank, world_size)
    try:
        timing = time_rank(s, shard, device)
        if rank == 0:
            Path(out).write_text(json.dumps(asdict(timing)))
    finally:
        if world_size > 1:
            dist.barrier()  # no rank leaves while another still talks to it
            dist.destroy_process_group()
    if world_size > 1:
        # done: leave without the interpreter's finalization, where a gloo group's worker
        # threads can abort the process (as the executor ranks do)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def fitting_context(s: Settings, ranks: int) -> int:
    """The longest context up to `s.context` whose KV for the batch fits on each GPU beside
    that GPU's share of the model when split over `ranks` (the fewest of the run), with room for
    activations and graphs."""
    if s.device != "cuda":
        return s.context
    meta = load_model(s.model, "meta", DTYPES[s.dtype])
    weights = sum(p.numel() for p in meta.model.parameters()) * DTYPES[s.dtype].itemsize / ranks
    free, _ = torch.cuda.mem_get_info(0)
    per_seq_token = meta.config.kv_bytes_per_token(DTYPES[s.dtype]) * (s.batch + 1) / ranks
    fits = int((free * 0.9 - weights - 6e9) // per_seq_token)
    context = min(s.context, fits // s.block_size * s.block_size - 1)
    if context < s.block_size:
        raise ValueError(f"{s.model} on {ranks} rank(s) leaves no room for a batch of {s.batch}")
    return context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:llama2-13b-gqa10")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4032)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--all-reduce",
        nargs="+",
        default=["nccl"],
        choices=ALL_REDUCE_MODES,
        help="each configuration of several ranks once in each mode",
    )
    parser.add_argument(
        "--prompt",
        type=int,
        default=Settings.prompt,
        help="prompt tokens beside the decodes in the mixed step",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--profile", action="store_true", help="the first rank's kernels by kind (torch.profiler)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny-llama, toy sizes")
    args = parser.parse_args(argv)
    os.environ.update(NCCL_ENV)
    s = Settings(
        args.model,
        args.dtype,
        args.batch,
        args.context,
        32,
        args.repeats,
        "cuda",
        args.prompt,
        args.profile,
    )
    if args.smoke:
        s = Settings("preset:tiny-llama", "float32", 4, 100, 16, 3, "cpu", 20)
    s = Settings(**{**asdict(s), "context": fitting_context(s, min(args.ranks))})
    print(f"[bench_tp] {s}", flush=True)
    timings: list[Timing] = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(r, m) for r in args.ranks for m in (args.all_reduce if r > 1 else ["nccl"])]
        for ranks, mode in runs:
            begin = time.perf_counter()
            out = Path(tmp) / f"ranks{ranks}_{mode}.json"
            store = str(Path(tmp) / f"store{ranks}_{mode}")
            mp.spawn(rank_main, (ranks, s, store, str(out), mode), nprocs=ranks)
            timings.append(Timing(**json.loads(out.read_text())))
            print(
                f"[bench_tp] {ranks} rank(s), {mode}: {timings[-1]} "
                f"({time.perf_counter() - begin:.0f} s)",
                flush=True,
            )
    if args.json is not None:
        results = {"settings": asdict(s), "timings": [asdict(t) for t in timings]}
        args.json.write_text(json.dumps(results, indent=1))
    print_table(s, timings)
    return 0


def print_table(s: Settings, timings: list[Timing]) -> None:
    base = timings[0]
    graphed = all(t.graph_s is not None for t in timings)  # compare like with like
    print(f"\ndecode step, {s.model} {s.dtype}, batch {s.batch} at context {s.context}")
    print(
        f"{'ranks':>5} {'reduce':>6} {'eager ms':>9} {'graph ms':>9} {'x first':>8}"
        f" {'read-bound ms':>14} {'copy GB/s':>10} {'allreduce us':>13}"
        f" {'in graph us':>12}"
    )
    for t in timings:
        step, first = (t.graph_s, base.graph_s) if graphed else (t.eager_s, base.eager_s)
        assert step is not None and first is not None
        graph = f"{t.graph_s * 1e3:9.2f}" if t.graph_s is not None else f"{'-':>9}"
        reduce = f"{t.allreduce_us:13.1f}" if t.allreduce_us is not None else f"{'-':>13}"
        graphed_reduce = (
            f"{t.allreduce_graph_us:12.1f}" if t.allreduce_graph_us is not None else f"{'-':>12}"
        )
        mode = t.all_reduce if t.ranks > 1 else "-"
        print(
            f"{t.ranks:>5} {mode:>6} {t.eager_s * 1e3:9.2f} {graph} {step / first:8.3f} "
            f"{t.read_bound_s * 1e3:14.2f} {t.copy_gb_s:10.0f} {reduce} {graphed_reduce}"
            + (f"  ({t.error})" if t.error else "")
        )
    print(f"\nmixed step: the same decodes beside a {s.prompt}-token prompt")
    print(
        f"{'ranks':>5} {'reduce':>6} {'eager ms':>9} {'graphs ms':>10} {'x eager':>8} "
        f"{'x first':>8}"
    )
    for t in timings:
        eager, graphs = t.mixed_eager_s, t.mixed_graph_s
        if eager is None:
            continue
        best, first = graphs or eager, base.mixed_graph_s or base.mixed_eager_s or eager
        cut = f"{graphs * 1e3:10.2f} {eager / graphs:8.3f}" if graphs else f"{'-':>10} {'-':>8}"
        mode = t.all_reduce if t.ranks > 1 else "-"
        print(f"{t.ranks:>5} {mode:>6} {eager * 1e3:9.2f} {cut} {best / first:8.3f}")
    if all(t.back_to_back_s is not None for t in timings):
        print("\nfrom graphs, launched back to back (inputs go up while the step before runs)")
        print(
            f"{'ranks':>5} {'reduce':>6} {'decode ms':>10} {'x first':>8} {'mixed ms':>9} "
            f"{'x first':>8}"
        )
        decode_first, mixed_first = base.back_to_back_s or (1.0, 1.0)
        for t in timings:
            decode, mixed = t.back_to_back_s or (0.0, 0.0)
            mode = t.all_reduce if t.ranks > 1 else "-"
            print(
                f"{t.ranks:>5} {mode:>6} {decode * 1e3:10.2f} {decode / decode_first:8.3f} "
                f"{mixed * 1e3:9.2f} {mixed / mixed_first:8.3f}"
            )
    for t in timings:
        for name, p in (t.profiles or {}).items():
            if "wall_ms" not in p:
                continue
            kinds = ", ".join(f"{kind} {ms:.2f}" for kind, ms in p["kinds_ms"].items())
            print(
                f"profile, {t.ranks} rank(s), {name} step from graphs: {p['wall_ms']:.2f} ms, "
                f"GPU busy {p['busy_ms']:.2f} ms; by kind (ms): {kinds}"
            )


if __name__ == "__main__":
    sys.exit(main())
