"""What the device did over a slice of steps, by kind of kernel, and (`StepProfile`) what an
executor rank's host did for each of those steps.

`ProfileWindow` runs torch.profiler (CUDA activity, or CPU on a CPU device) over the steps whose
number falls in [first, first + count), and sums the kernels' device time by kind (matmul,
attention, all-reduce, ...) and how much of the slice the device was busy. It keeps each
all-reduce's duration in order: every rank runs the same plans, so the i-th all-reduce of one
rank is the i-th of the others, and the shortest of them is the transfer while what a rank
spends over it is waiting for a late peer (`all_reduce_wait`).

An executor rank profiles itself when `PENSIEVE_PROFILE_STEPS=DIR,FIRST,COUNT` is set in its
environment: it writes `DIR/rank<r>.json` as soon as step FIRST + COUNT is launched (the
benchmarks' `--profile`, e.g. `bench_tp_replay --profile 400,100`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PROFILE_ENV = "PENSIEVE_PROFILE_STEPS"

# kernel name fragments -> what the kernel does (first match wins)
KERNEL_KINDS = (
    ("copy_blocks", "swap copy"),
    ("memcpy", "memcpy"),
    ("paged_attention", "attention"),
    ("merge_splits", "attention"),
    ("write_kv", "kv write"),
    ("rope_write", "kv write"),
    ("add_rms_norm", "norm"),
    ("silu_mul", "silu"),
    ("nccl", "all-reduce"),
    ("all_reduce", "all-reduce"),
    ("allreduce", "all-reduce"),
    ("gemm", "matmul"),
    ("nvjet", "matmul"),
    ("cutlass", "matmul"),
    ("xmma", "matmul"),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for part, kind in KERNEL_KINDS if part in low), "other")


class ProfileWindow:
    """torch.profiler over the steps whose `on_step` mark falls in [start, start + length): a
    time in seconds, or a step number. `finish` sums the kernels' device time by kind and
    measures how much of the slice the device was busy (union of kernel intervals, with and
    without the copies)."""

    def __init__(self, start: float, length: float, cuda: bool = True) -> None:
        self.start, self.end = start, start + length
        self.cuda = cuda
        self.profiler: Any = None
        self.began = self.ended = 0.0

    def on_step(self, now: float) -> None:
        if self.profiler is None and self.start <= now < self.end:
            import torch.profiler

            activity = torch.profiler.ProfilerActivity
            self.profiler = torch.profiler.profile(
                activities=[activity.CUDA if self.cuda else activity.CPU]
            )
            self.profiler.__enter__()
            self.began = time.perf_counter()
        elif self.profiler is not None and not self.ended and now >= self.end:
            self.stop()

    @property
    def done(self) -> bool:
        return bool(self.ended)

    def stop(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.ended = time.perf_counter()
        self.profiler.__exit__(None, None, None)

    def finish(self) -> dict[str, Any]:
        if self.profiler is None:
            return {"status": "no step in the window"}
        try:
            if not self.ended:
                self.stop()
            return self._summary()
        except Exception as exc:  # noqa: BLE001 - a profile is a diagnostic, never a failure
            return {"status": f"profile failed: {type(exc).__name__}: {exc}"}

    def _summary(self) -> dict[str, Any]:
        kinds: dict[str, float] = {}
        names: dict[str, float] = {}
        spans: list[tuple[float, float, bool]] = []  # (start us, end us, is a copy)
        reduces: list[tuple[float, float]] = []  # (start us, length us) of each all-reduce
        device = "CUDA" if self.cuda else "CPU"
        for event in self.profiler.events():
            if str(event.device_type).split(".")[-1] != device:
                continue
            name = event.name
            us = event.time_range.end - event.time_range.start
            kind = kernel_kind(name)
            if not self.cuda and not name.startswith(("aten::", "c10d::", "gloo:")):
                continue  # on the CPU: the operators only, not Python's or the profiler's
            kinds[kind] = kinds.get(kind, 0.0) + us / 1e6
            names[name] = names.get(name, 0.0) + us / 1e6
            spans.append(
                (event.time_range.start, event.time_range.end, kind in ("swap copy", "memcpy"))
            )
            if kind == "all-reduce":
                reduces.append((event.time_range.start, us))
        if not spans:  # no per-kernel events: the per-name totals only
            for avg in self.profiler.key_averages():
                us = getattr(avg, "self_device_time_total", 0.0)
                if us > 0:
                    kinds[kernel_kind(avg.key)] = kinds.get(kernel_kind(avg.key), 0.0) + us / 1e6
                    names[avg.key] = us / 1e6
        top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
        return {
            "wall_s": self.ended - self.began,
            "busy_s": _union(spans) / 1e6,
            "compute_busy_s": _union([sp for sp in spans if not sp[2]]) / 1e6,
            "kinds_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top_kernels_s": [[name[:80], sec] for name, sec in top],
            "all_reduce_us": [round(us, 2) for _, us in sorted(reduces)],
        }


def _union(spans: Sequence[tuple[float, float, bool]]) -> float:
    """Total length covered by the intervals."""
    total = 0.0
    reach = -math.inf
    for start, end, _ in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class StepProfile:
    """One executor rank's profile of steps FIRST to FIRST + COUNT - 1: the device's kernels
    (`ProfileWindow`) and, per step, the host's time to launch it and the time its results
    thread waited for the step's tokens; written once as `DIR/rank<r>.json`."""

    def __init__(self, folder: Path, first: int, count: int, rank: int, cuda: bool) -> None:
        self.path = folder / f"rank{rank}.json"
        self.rank = rank
        self.window = ProfileWindow(first, count, cuda)
        self.first, self.last = first, first + count - 1
        self.launch_s: list[float] = []
        self.result_s: list[float] = []
        self._written = False

    @classmethod
    def from_env(cls, rank: int, cuda: bool) -> StepProfile | None:
        spec = os.environ.get(PROFILE_ENV)
        if not spec:
            return None
        try:
            folder, first, count = spec.split(",")
            return cls(Path(folder), int(first), int(count), rank, cuda)
        except ValueError:
            wanted = f"{PROFILE_ENV} is DIR,FIRST,COUNT (step numbers)"
            raise ValueError(f"{wanted}, got {spec!r}") from None

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last

    def before_launch(self, step: int) -> None:
        """On the launching thread, before step `step` is launched: the kernels of steps FIRST
        to LAST are recorded, and the profile is written once a later step comes."""
        self.window.on_step(step)
        if self.window.done and not self._written:  # stopped: its events are read off the loop
            self._written = True
            threading.Thread(target=self._write, daemon=True).start()

    def launched(self, step: int, seconds: float) -> None:
        if self.wants(step):
            self.launch_s.append(seconds)

    def answered(self, step: int, seconds: float) -> None:
        if self.wants(step):
            self.result_s.append(seconds)

    def _write(self) -> None:
        summary = self.window.finish()

        def ms(values: list[float]) -> dict[str, float]:
            if not values:
                return {}
            return {
                "mean": 1e3 * statistics.fmean(values),
                "p50": 1e3 * statistics.median(values),
                "max": 1e3 * max(values),
            }

        found = {
            "rank": self.rank,
            "steps": [self.first, self.last],
            "launch_ms": ms(self.launch_s),
            "result_ms": ms(self.result_s),
            "device": summary,
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(found))
        except OSError:
            logger.exception("the step profile could not be written to %s", self.path)


def all_reduce_wait(ranks: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Each rank's all-reduces (their durations in order, the same calls on every rank) split
    into the transfer, the shortest of the same call on any rank, and the wait, what the rank
    spent over it (for its peers to arrive). Seconds in all, over the calls every rank has."""
    calls = min((len(r) for r in ranks), default=0)
    if calls == 0:
        return {"calls": 0}
    transfer_us = sum(min(r[i] for r in ranks) for i in range(calls))
    total_us = [sum(r[:calls]) for r in ranks]
    return {
        "calls": calls,
        "transfer_s": transfer_us / 1e6,
        "total_s": [us / 1e6 for us in total_us],
        "wait_s": [(us - transfer_us) / 1e6 for us in total_us],
    }
