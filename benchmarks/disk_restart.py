"""What the disk tier buys in serving: the time to first token of the turn after a restart, and
the agentic workload's goodput when its sessions outgrow the GPU and CPU tiers.

    python -m benchmarks.disk_restart restart --dir DIR --model preset:llama3.1-8b \
        --device cuda --dtype bfloat16 --tokenizer .bench/tokenizer \
        [--conversations 64] [--history 8192] [--message 64]
    python -m benchmarks.disk_restart agentic --dir DIR [--disk-gb 200] -- BENCH OPTIONS...

`restart`, in one process on one device, with random token ids as the conversations' text:

1. an engine with the disk tier in `DIR` (a fresh folder in it) runs a first turn of each
   conversation (`--history` tokens), all at once; its GPU tier holds two histories, so the
   others go to the CPU tier;
2. (a) the next turn of each conversation, one after the other: its history is swapped in from
   the CPU tier (hits); then the tiers are written back to disk and the engine stopped, as on a
   SIGTERM;
3. (b) a new engine on the same folder, knowing the conversations from their token logs only,
   runs the turn after that for each: the histories are read back from disk;
4. (c) a new engine without the disk tier runs the same turns: the histories are recomputed.

Each turn adds `--message` tokens and generates `--max-tokens`. The table last gives the TTFT
p50 and p90 of each phase, where its prompt tokens came from, and the ratios the disk tier aims
at: disk at most 1.5x CPU hits and at most 1/3 of recomputing. The disk budget, CPU tier and
folder must hold every history (64 x 8k tokens of Llama-3.1-8B: 64 GiB): `--conversations`
scales it down.

`agentic` runs `benchmarks/gpu_agentic.sh` on the same sessions against `pensieve serve` without
and with `--disk-cache-dir DIR --disk-cache-gb N`, and with it once more per `--read-gbps` rate
given as `--disk-read-gbps` (options after `--` go to `pensieve bench agentic`; MODEL_ARGS picks
the model and tiers, small enough that the sessions outgrow them), and prints the goodput of
each and its ratio to the server without the tier (target: at least 1.2x).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.request import Request, TokenSources
from pensieve.actors.wire.step import SamplingParams
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import GIB, Built, assemble, build

WARMUP = "warmup"


@dataclasses.dataclass
class Phase:
    name: str
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    sources: TokenSources = dataclasses.field(default_factory=TokenSources)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_turn(engine: Engine, conv_id: str, prompt: list[int], max_tokens: int) -> Request:
    """Run one turn alone; its TTFT (from its arrival to its first token) in `request.ttft`."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    begin = time.perf_counter()
    request = engine.add_request(conv_id, prompt, sampling)
    first = None
    while engine.has_work():
        engine.step()
        if first is None and request.output_ids:
            first = time.perf_counter() - begin
    if request.error is not None or first is None:
        raise RuntimeError(f"{conv_id}: {request.error or 'no token'}")
    request.ttft = first  # type: ignore[attr-defined]
    return request


def run_phase(
    engine: Engine, name: str, prompts: dict[str, list[int]], max_tokens: int
) -> tuple[Phase, dict[str, list[int]]]:
    """Each conversation's turn, one after the other; the phase and the token logs after it."""
    timed_turn(engine, WARMUP, [7] * 64, 2)  # kernels compiled, graphs captured
    engine.forget(WARMUP)
    phase, logs = Phase(name), {}
    for conv_id, prompt in prompts.items():
        request = timed_turn(engine, conv_id, prompt, max_tokens)
        phase.ttft_s.append(request.ttft)  # type: ignore[attr-defined]
        phase.sources = phase.sources + request.sources
        logs[conv_id] = request.all_ids
    return phase, logs


def fill(
    engine: Engine, histories: dict[str, list[int]], max_tokens: int, check: bool = False
) -> dict[str, list[int]]:
    """Every conversation's first turn, all at once; their token logs. With `check`, the cache
    manager's invariants are checked after every step, and the first broken one printed with
    the requests' states."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = {c: engine.add_request(c, p, sampling) for c, p in histories.items()}
    steps, broken = 0, False
    while engine.has_work():
        engine.step()
        steps += 1
        if check and not broken:
            try:
                engine.kv.check_invariants()
            except AssertionError as error:
                broken = True
                print(f"step {steps}: {error}")
                for conv_id, request in requests.items():
                    conv = engine.kv.conversations.get(conv_id)
                    chunks = len(conv.chunks) if conv is not None else None
                    positions = conv.num_positions if conv is not None else None
                    print(
                        f"  {conv_id} {request.status.name} pending={request.pending[:2]} "
                        f"inflight={request.inflight} suspensions={request.num_suspensions} "
                        f"positions={positions} chunks={chunks}"
                    )
    return {conv_id: request.all_ids for conv_id, request in requests.items()}


def restarted(built: Built, options: EngineOptions, logs: dict[str, list[int]]) -> Engine:
    """A new engine knowing the conversations from their token logs only (after the one
    before it is released)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine = assemble(options, built.loaded, built.chat).engine
    for conv_id, log in logs.items():
        engine.restore(conv_id, log)
    return engine


def stop(engine: Engine, write_back: bool) -> None:
    """Stop an engine (the caller drops it after): its tiers written back to disk if asked."""
    if engine.disk is not None:
        if write_back:
            engine.write_back()
        engine.disk.close()
    engine.runner.settle()


def restart(args: argparse.Namespace) -> int:
    n, history, message = args.conversations, args.history, args.message
    per_conv = history + 3 * (message + args.max_tokens) + 64
    rng = random.Random(args.seed)
    base = EngineOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        gpu_cache_tokens=args.gpu_cache_tokens or 2 * per_conv,
        cpu_cache_tokens=args.cpu_cache_tokens or int(1.2 * n * per_conv),
        admission_reserve=0.0,
        max_model_len=per_conv,
        max_batch_tokens=args.max_batch_tokens,
    )
    folder = Path(tempfile.mkdtemp(prefix="disk-restart-", dir=args.dir))
    try:
        # the weights and tokenizer, loaded once for every engine (this one's tiers are tiny)
        tiny = dataclasses.replace(
            base, gpu_cache_tokens=256, cpu_cache_tokens=0, max_model_len=None
        )
        built = build(tiny)
        config = built.loaded.config
        token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        token_bytes *= torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        disk_gb = args.disk_gb or 1.2 * n * per_conv * token_bytes / GIB
        free_gb = shutil.disk_usage(folder).free / GIB
        if disk_gb > free_gb:
            raise SystemExit(f"{disk_gb:.1f} GiB of histories; {args.dir} has {free_gb:.1f} free")
        disk = dataclasses.replace(
            base,
            disk_cache_dir=str(folder),
            disk_cache_gb=disk_gb,
            disk_read_gbps=args.disk_read_gbps,
        )
        vocab = min(config.vocab_size, 32000)

        def text(length: int) -> list[int]:
            return [rng.randrange(100, vocab) for _ in range(length)]

        engine = assemble(disk, built.loaded, built.chat).engine
        first = {f"conv{i}": text(history) for i in range(n)}
        logs = fill(engine, first, args.max_tokens, args.check)
        turn = {conv_id: log + text(message) for conv_id, log in logs.items()}
        hits, logs = run_phase(engine, "(a) CPU tier hits", turn, args.max_tokens)
        stop(engine, write_back=True)  # as on a SIGTERM
        turn = {conv_id: log + text(message) for conv_id, log in logs.items()}
        engine = restarted(built, disk, logs)
        reads, _ = run_phase(engine, "(b) restart, disk", turn, args.max_tokens)
        stop(engine, write_back=False)
        engine = restarted(built, base, logs)
        recompute, _ = run_phase(engine, "(c) restart, recompute", turn, args.max_tokens)
        del engine
        report([hits, reads, recompute], args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def report(phases: list[Phase], args: argparse.Namespace) -> None:
    print(
        f"{args.model}, {args.conversations} conversations of {args.history} tokens, "
        f"+{args.message} a turn, on {args.device}"
    )
    print(f"{'phase':<24} {'p50 ms':>8} {'p90 ms':>8}  prompt tokens: gpu cpu disk recomputed new")
    for phase in phases:
        s = phase.sources
        p50, p90 = phase.percentile(0.5) * 1e3, phase.percentile(0.9) * 1e3
        print(
            f"{phase.name:<24} {p50:8.1f} {p90:8.1f}  "
            f"{s.gpu} {s.cpu} {s.disk} {s.recomputed} {s.new}"
        )
    hits, reads, recompute = (phase.percentile(0.5) for phase in phases)
    print(f"p50 disk / CPU hits: {reads / hits:.2f} (target <= 1.5)")
    print(f"p50 disk / recompute: {reads / recompute:.2f} (target <= 0.33)")


def agentic(args: argparse.Namespace) -> int:
    out = Path(args.out)
    bench = [a for a in args.bench if a != "--"]
    for rate in [False, None, *args.read_gbps]:  # False: without the tier
        cache = args.dir / f"agentic-disk-{rate}"
        variant = "pensieve"
        if rate is not False:
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
            variant += f":--disk-cache-dir,{cache},--disk-cache-gb,{args.disk_gb or 200:g}"
            if rate is not None:
                variant += f",--disk-read-gbps,{rate:g}"
        environment = {**os.environ, "VARIANTS": variant, "APIS": "nats"}
        subprocess.run(["bash", "benchmarks/gpu_agentic.sh", str(out), *bench], env=environment)
        shutil.rmtree(cache, ignore_errors=True)  # the next server's room on the disk
    goodput = {}
    for result in sorted(out.glob("pensieve*_nats.json")):
        runs = json.loads(result.read_text()).get("runs", [])
        goodput[result.stem] = [_goodput(run) for run in runs]
    print(f"{'server':<40} goodput, turns/s (each run)")
    for name, values in goodput.items():
        print(f"{name:<40} {' '.join(f'{v:.2f}' for v in values)}")
    plain = goodput.get("pensieve_nats", [])
    for name, values in goodput.items():
        if "disk" not in name:
            continue
        for before, after in zip(plain, values, strict=False):
            ratio = after / before if before else float("nan")
            print(f"{name} / without the disk tier: {ratio:.2f}")
    return 0


def _goodput(run: dict[str, Any]) -> float:
    summary = run.get("summary", run)
    return float(summary.get("goodput", {}).get("turns_per_s", 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    one = modes.add_parser("restart", help="TTFT after a restart: CPU hits, disk, recompute")
    one.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    one.add_argument("--model", default="smollm2")
    one.add_argument("--device", default="cpu")
    one.add_argument("--dtype", default="float32")
    one.add_argument("--tokenizer", default=None)
    one.add_argument("--conversations", type=int, default=64)
    one.add_argument("--history", type=int, default=8192, help="tokens of each first turn")
    one.add_argument("--message", type=int, default=64, help="tokens each later turn adds")
    one.add_argument("--max-tokens", type=int, default=2)
    one.add_argument("--gpu-cache-tokens", type=int, default=None)
    one.add_argument("--cpu-cache-tokens", type=int, default=None)
    one.add_argument("--max-batch-tokens", type=int, default=2048)
    one.add_argument("--check", action="store_true", help="check the cache's books each step")
    one.add_argument("--disk-gb", type=float, default=None)
    one.add_argument("--disk-read-gbps", type=float, default=None, help="default: measured")
    one.add_argument("--seed", type=int, default=0)
    two = modes.add_parser("agentic", help="agentic goodput with the disk tier and without")
    two.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    two.add_argument("--disk-gb", type=float, default=None)
    two.add_argument("--out", default="disk_agentic")
    two.add_argument(
        "--read-gbps",
        type=float,
        nargs="*",
        default=[],
        help="a server more with the disk tier per rate, taken as its read rate (100: read "
        "every chunk the disk holds rather than recompute it)",
    )
    two.add_argument("bench", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    return restart(args) if args.mode == "restart" else agentic(args)


if __name__ == "__main__":
    raise SystemExit(main())
