"""What `vllm bench serve` reports, computed from a bench run's requests, under its names: so
that a Pensieve run and a vLLM run are read side by side.

Successful and failed requests, duration, request, output and total token throughput, the
peak output tokens in a second and the requests in flight then, and for each chosen metric
(TTFT, TPOT, ITL, E2EL) its mean, median, standard deviation and chosen percentiles in
milliseconds, percentiles interpolated as numpy's are. Goodput: requests a second that meet
every `--goodput` objective. Beside them, the same latencies for each turn index of a
multi-turn load. A figure with nothing to measure is `None` (JSON `null`), never NaN.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

METRICS = {  # vLLM's names, and the header it prints above each
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(frozen=True)
class Request:
    """One request that got its whole answer, in perf_counter seconds."""

    sent: float
    arrived: tuple[float, ...]  # each streamed chunk (none: not streamed)
    done: float
    prompt_tokens: int
    output_tokens: int
    turn: int = 0  # its index in its conversation, from 0

    @property
    def ttft_s(self) -> float:
        return (self.arrived[0] if self.arrived else self.done) - self.sent

    @property
    def e2el_s(self) -> float:
        return self.done - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with one token)."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Between streamed chunks."""
        return [b - a for a, b in pairwise(self.arrived)]


@dataclass(frozen=True)
class Goodput:
    """`--goodput`: the objectives a request meets to count, in milliseconds (None: none)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, pairs: Sequence[str] | None) -> Goodput | None:
        """`ttft:MS tpot:MS e2el:MS`, any of them, as `vllm bench serve --goodput` takes."""
        if not pairs:
            return None
        found: dict[str, float] = {}
        for pair in pairs:
            name, _, number = pair.partition(":")
            if name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS and e2el:MS, got {pair!r}")
            try:
                found[f"{name}_ms"] = float(number)
            except ValueError:
                raise ValueError(f"--goodput {name}: milliseconds, got {number!r}") from None
            if not found[f"{name}_ms"] >= 0:
                raise ValueError(f"--goodput {name} must be >= 0")
        return cls(**found)

    def meets(self, request: Request) -> bool:
        """As vLLM has it: a request of one token has a TPOT of 0."""
        measured = (request.ttft_s, request.tpot_s or 0.0, request.e2el_s)
        limits = (self.ttft_ms, self.tpot_ms, self.e2el_ms)
        return all(ms is None or s * 1000 <= ms for s, ms in zip(measured, limits, strict=True))


@dataclass(frozen=True)
class Report:
    """Which metrics get percentiles, which percentiles, and the goodput's objectives."""

    metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    percentiles: tuple[float, ...] = (99.0,)
    goodput: Goodput | None = None


def report_of(args: argparse.Namespace) -> Report:
    """The report `--percentile-metrics`, `--metric-percentiles` and `--goodput` choose."""
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if not metrics or not set(metrics) <= set(METRICS):
        raise ValueError(
            f"--percentile-metrics takes {','.join(METRICS)}, got {args.percentile_metrics!r}"
        )
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(
            f"--metric-percentiles: numbers separated by commas, got {args.metric_percentiles!r}"
        ) from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be between 0 and 100")
    return Report(metrics, percentiles, Goodput.parse(args.goodput))


def add_report_args(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("the vllm bench serve figures")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        metavar="M,M,...",
        help="the metrics whose percentiles are reported, of ttft, tpot, itl, e2el",
    )
    out.add_argument(
        "--metric-percentiles",
        default="99",
        metavar="P,P,...",
        help="the percentiles reported, e.g. 25,50,99",
    )
    out.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="request goodput: requests a second within every objective, of ttft:MS, "
        "tpot:MS and e2el:MS (default: not reported)",
    )


def percentile(values: Sequence[float], p: float) -> float:
    """numpy's default (linear) percentile of `values`, not empty."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * p / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def latencies(requests: Sequence[Request], report: Report) -> dict[str, float | None]:
    """For each chosen metric: mean, median, std and the chosen percentiles in ms."""
    found: dict[str, float | None] = {}
    for name in report.metrics:
        values = _values(requests, name)
        ms = [v * 1000 for v in values]
        mean = sum(ms) / len(ms) if ms else None
        found[f"mean_{name}_ms"] = mean
        found[f"median_{name}_ms"] = percentile(ms, 50) if ms else None
        std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if mean is not None else None
        found[f"std_{name}_ms"] = std
        for p in report.percentiles:
            found[f"p{_word(p)}_{name}_ms"] = percentile(ms, p) if ms else None
    return found


def _values(requests: Sequence[Request], name: str) -> list[float]:
    if name == "ttft":
        return [r.ttft_s for r in requests]
    if name == "tpot":
        return [t for r in requests if (t := r.tpot_s) is not None]
    if name == "itl":
        return [gap for r in requests for gap in r.itl_s]
    return [r.e2el_s for r in requests]


def serving_metrics(
    requests: Sequence[Request], failed: int, duration_s: float, report: Report
) -> dict[str, Any]:
    """`vllm bench serve`'s result fields for these requests over `duration_s`, and
    `per_turn`: the latencies of each turn index."""
    inputs = sum(r.prompt_tokens for r in requests)
    outputs = sum(r.output_tokens for r in requests)

    def per_s(n: float) -> float | None:
        return n / duration_s if duration_s > 0 else None

    goodput = report.goodput
    peak_tokens, peak_requests = _peak(requests)
    return {
        "duration": duration_s,
        "completed": len(requests),
        "failed": failed,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": per_s(len(requests)),
        "request_goodput": None
        if goodput is None
        else per_s(sum(goodput.meets(r) for r in requests)),
        "output_throughput": per_s(outputs),
        "total_token_throughput": per_s(inputs + outputs),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        **latencies(requests, report),
        "per_turn": [
            {"turn": turn, "completed": len(of_turn), **latencies(of_turn, report)}
            for turn in sorted({r.turn for r in requests})
            for of_turn in [[r for r in requests if r.turn == turn]]
        ],
    }


def _peak(requests: Sequence[Request]) -> tuple[float, int]:
    """The most output tokens that arrived within one second of the run (each chunk carrying
    its share of its request's tokens), and the requests in flight in that second."""
    if not requests:
        return 0.0, 0
    start = min(r.sent for r in requests)
    tokens: dict[int, float] = defaultdict(float)
    in_flight: Counter[int] = Counter()
    for r in requests:
        chunks = r.arrived or (r.done,)
        for at in chunks:
            tokens[int(at - start)] += r.output_tokens / len(chunks)
        for second in range(int(r.sent - start), int(r.done - start) + 1):
            in_flight[second] += 1
    peak = max(tokens, key=lambda s: tokens[s])
    return tokens[peak], in_flight[peak]


def format_result(title: str, result: dict[str, Any], report: Report) -> str:
    """The result as `vllm bench serve` prints it, and a line per turn index."""
    lines = [f" {title} ".center(50, "=")]

    def row(name: str, value: Any, digits: int = 2) -> None:
        text = (
            "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else value
        )
        lines.append(f"{name:<40} {text:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if "concurrency" in result:
        row("Maximum request concurrency:", result["concurrency"])
    if "request_rate" in result:
        row("Request rate configured (RPS):", float(result["request_rate"]))
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if report.goodput is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", float(result["max_concurrent_requests"]))
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for name in report.metrics:
        short, header = METRICS[name]
        lines.append(header.center(50, "-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in report.percentiles:
            row(f"P{_word(p)} {short} (ms):", result[f"p{_word(p)}_{name}_ms"])
    if len(result["per_turn"]) > 1:
        lines.append("By turn index (mean / median ms)".center(50, "-"))
        for turn in result["per_turn"]:
            cells = "  ".join(
                f"{METRICS[name][0]} {_ms(turn[f'mean_{name}_ms'])}/"
                f"{_ms(turn[f'median_{name}_ms'])}"
                for name in report.metrics
            )
            lines.append(f"turn {turn['turn']} ({turn['completed']} requests): {cells}")
    lines.append("=" * 50)
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def finite(found: Any) -> Any:
    """`found` with every NaN or infinity made None: JSON that strict parsers read."""
    if isinstance(found, float):
        return found if math.isfinite(found) else None
    if isinstance(found, dict):
        return {k: finite(v) for k, v in found.items()}
    if isinstance(found, list | tuple):
        return [finite(v) for v in found]
    return found
