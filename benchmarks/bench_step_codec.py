"""Host time to encode and decode one step of the per-step channel (CPU only, no bus).

A batch of 256 running decodes, each with a block table of about 64 blocks (2k tokens of
context in 32-token blocks), goes through the scheduler's `PlanEncoder` and the executor's
`PlanDecoder` step after step: each step is a diff (one token each; a request gains a block
every 32 steps). Also timed: a step in which all 256 requests are new to the executor (sent in
full), and the executor's `StepResult` of 256 tokens. Medians over many repetitions.

    python3 -m benchmarks.bench_step_codec [--batch 256] [--blocks 64] [--reps 2000]

It also runs against a build whose actors/ package is flat, so two builds compare side by side,
in one table each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

try:  # the codec in actors/wire/
    from pensieve.actors.wire.step import PLACEHOLDER, SamplingParams, SeqPiece, StepPlan
    from pensieve.actors.wire.step_codec import PlanDecoder, PlanEncoder, StepResult
except ImportError:  # a build with a flat actors/ package, to compare side by side
    from pensieve.actors.request import (  # type: ignore[no-redef,import-not-found]
        PLACEHOLDER,
        SamplingParams,
    )
    from pensieve.actors.step import SeqPiece, StepPlan  # type: ignore[no-redef,import-not-found]
    from pensieve.actors.step_channel import (  # type: ignore[no-redef,import-not-found]
        PlanDecoder,
        PlanEncoder,
        StepResult,
    )

BLOCK_SIZE = 32


class Batch:
    """`batch` running requests, each at its own context length, decoding one token a step."""

    def __init__(self, batch: int, blocks: int, seed: int) -> None:
        rng = random.Random(seed)
        free = list(range(batch * (blocks + 8) * 2))
        rng.shuffle(free)
        self.free = free
        self.lengths = [
            rng.randint((blocks - 1) * BLOCK_SIZE, blocks * BLOCK_SIZE) for _ in range(batch)
        ]
        self.tables = [[self.free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in self.lengths]
        # each request's own parameters, the same object every step (as the scheduler keeps them)
        self.params = [
            SamplingParams(max_tokens=512, temperature=0.7, top_p=0.95, seed=i)
            if i % 4
            else SamplingParams(max_tokens=512)
            for i in range(batch)
        ]
        self.num_steps = 0

    def step(self) -> StepPlan:
        """The next decode step: one placeholder token each, a new block where one fills."""
        pieces = []
        for i, n in enumerate(self.lengths):
            if n % BLOCK_SIZE == 0:
                self.tables[i].append(self.free.pop())
            table = tuple(self.tables[i])
            pieces.append(
                SeqPiece(
                    f"c-{i:08x}-0123456789abcdef#{i}",
                    (PLACEHOLDER,),
                    n,
                    n + 1,
                    table,
                    self.params[i],
                    self.num_steps,
                )
            )
            self.lengths[i] = n + 1
        self.num_steps += 1
        return StepPlan(tuple(pieces))


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    begin = time.perf_counter_ns()
    out = fn(*args)
    return (time.perf_counter_ns() - begin) / 1000, out


def running(batch: int, blocks: int, reps: int) -> dict[str, float]:
    """Steady-state decode steps, each a diff against the step before."""
    decodes = Batch(batch, blocks, seed=0)
    encoder, decoder = PlanEncoder(), PlanDecoder()
    decoder.decode(encoder.encode(1, decodes.step(), None))  # the first step: all new
    plans = [decodes.step() for _ in range(reps)]  # made outside the timed part
    enc, dec, size = [], [], 0
    for step, plan in enumerate(plans, start=2):
        t_enc, data = _timed(encoder.encode, step, plan, step - 1)
        t_dec, got = _timed(decoder.decode, data)
        assert got is not None and len(got.plan.pieces) == batch
        enc.append(t_enc)
        dec.append(t_dec)
        size = len(data)
    return {"encode": statistics.median(enc), "decode": statistics.median(dec), "bytes": size}


def all_new(batch: int, blocks: int, reps: int) -> dict[str, float]:
    """A step whose every request is new to the executor: tables and parameters in full."""
    plan = Batch(batch, blocks, seed=1).step()
    enc, dec, size = [], [], 0
    for _ in range(max(reps // 4, 50)):
        encoder, decoder = PlanEncoder(), PlanDecoder()
        t_enc, data = _timed(encoder.encode, 1, plan, None)
        t_dec, _ = _timed(decoder.decode, data)
        enc.append(t_enc)
        dec.append(t_dec)
        size = len(data)
    return {"encode": statistics.median(enc), "decode": statistics.median(dec), "bytes": size}


def result(batch: int, reps: int) -> dict[str, float]:
    """The executor's answer: one sampled token per request, its swap totals and device time."""
    rng = random.Random(2)
    tokens = [rng.randrange(32000) for _ in range(batch)]
    swaps = [1080.0, 5772.0, 7077888000.0, 37827379200.0, 0.165, 0.725]
    answer = StepResult(4182, tokens, None, swaps, device=[812.4, 6.1])
    enc, dec, size = [], [], 0
    for _ in range(reps):
        t_enc, data = _timed(answer.encode)
        t_dec, _ = _timed(StepResult.decode, data)
        enc.append(t_enc)
        dec.append(t_dec)
        size = len(data)
    return {"encode": statistics.median(enc), "decode": statistics.median(dec), "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=64, help="blocks in each block table")
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    rows = {
        f"plan, {args.batch} running (diffs)": running(args.batch, args.blocks, args.reps),
        f"plan, {args.batch} new (in full)": all_new(args.batch, args.blocks, args.reps),
        f"result, {args.batch} tokens": result(args.batch, args.reps),
    }
    print(f"{'message':<28} {'encode µs':>10} {'decode µs':>10} {'total µs':>10} {'bytes':>8}")
    for name, row in rows.items():
        total = row["encode"] + row["decode"]
        times = f"{row['encode']:>10.1f} {row['decode']:>10.1f} {total:>10.1f}"
        print(f"{name:<28} {times} {row['bytes']:>8.0f}")


if __name__ == "__main__":
    main()
