"""The scheduler's Prometheus metrics, named as vLLM names its own (`pensieve:` for `vllm:`).

Two kinds, both in one `CollectorRegistry` per chat service:

- per turn, updated once when a turn's reply is sent (`observe_turn`, on the store writer's
  thread), from the same request the reply's `usage` is made of, so the counters move by
  exactly what the replies say: prompt tokens by where their KV came from, generated tokens,
  finished requests, and the latency histograms;
- the engine's state and totals (requests running and waiting, KV usage per tier, swaps,
  suspensions), read at scrape time from the stats the engine thread keeps (`follow_engine`),
  so the step loop does no work for them; chunks leaving the tiers are counted from the KV
  events, once per step that has any.

The Prometheus text comes from `exposition`; the HTTP ingress serves it on `/metrics`, and so
does `--metrics-port`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pensieve.actors.scheduler.request import Request
from pensieve.actors.wire.messages import KvEvent, KvEventKind

PREFIX = "pensieve:"
SOURCES = ("gpu", "cpu", "disk", "recomputed", "new")
# vLLM's buckets, so dashboards made for it read these the same way
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

EngineStats = Callable[[], dict[str, Any]]  # `ChatService.stats()` as of a recent step


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.prompt_sources = Counter(
            PREFIX + "prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: the GPU tier, the CPU tier, the disk "
            "tier, recomputed from the stored tokens, or new",
            ["source"],
            registry=r,
        )
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the KV cache", registry=r
        )
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits",
            "Prompt tokens whose KV was cached (GPU or CPU tier)",
            registry=r,
        )
        self.prefix_shared_hits = Counter(
            PREFIX + "prefix_cache_shared_hits",
            "Prompt tokens whose KV was found by content in chunks another conversation computed "
            "(of the hits)",
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.success = Counter(
            PREFIX + "request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end request latency in the engine",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time from arrival to first admission",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.chunks = Counter(
            PREFIX + "kv_chunks",
            "KV chunks that left a tier: evicted (to the CPU tier) or dropped (from the cache)",
            ["event"],
            registry=r,
        )
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        for source in SOURCES:  # every series exists from the start, at 0
            self.prompt_sources.labels(source)
        for event in ("evicted", "dropped"):
            self.chunks.labels(event)

    def observe_turn(self, request: Request) -> None:
        """A finished turn whose reply goes out now (any thread)."""
        sources = request.sources
        self.prompt_tokens.inc(len(request.prompt_ids))
        for source in SOURCES:
            self.prompt_sources.labels(source).inc(getattr(sources, source))
        self.prefix_queries.inc(len(request.prompt_ids))
        self.prefix_hits.inc(sources.gpu + sources.cpu + sources.disk)
        self.prefix_shared_hits.inc(sources.shared)
        num_output = len(request.output_ids)
        self.generation_tokens.inc(num_output)
        reason = request.finish_reason.value if request.finish_reason else "abort"
        self.success.labels(reason).inc()
        first, finish = request.first_token_time, request.finish_time
        if first is not None:
            self.ttft.observe(first - request.arrival)
            if finish is not None and num_output > 1:
                self.tpot.observe((finish - first) / (num_output - 1))
        if finish is not None:
            self.e2e.observe(finish - request.arrival)
        if request.admitted_at is not None:
            self.queue.observe(request.admitted_at - request.arrival)

    def count_kv_events(self, events: Sequence[KvEvent]) -> None:
        """One step's KV events (engine thread). A move of a shared chunk is one event for each
        of its users, one after the other: it counts once."""
        evicted = dropped = 0
        last = None
        for event in events:
            move = (event.kind, event.key, event.index, event.gpu_block, event.cpu_slot)
            if event.key is not None and move == last:
                continue  # another user's event of the same chunk's move
            last = move
            if event.kind is KvEventKind.SWAPPED_OUT:
                evicted += 1
            elif event.kind is KvEventKind.DROPPED:
                dropped += 1
        if evicted:
            self.chunks.labels("evicted").inc(evicted)
        if dropped:
            self.chunks.labels("dropped").inc(dropped)

    def follow_engine(self, stats: EngineStats) -> None:
        """Report the engine's state and totals from `stats`, read at each scrape."""
        self._engine.stats = stats

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text format (`subjects.METRICS_CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.stats: EngineStats | None = None  # None: no engine thread to read

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        stats = self.stats()
        requests, cache, swaps = stats["requests"], stats["cache"], stats["swaps"]
        yield GaugeMetricFamily(
            PREFIX + "num_requests_running", "Requests in the batch", value=requests["running"]
        )
        yield GaugeMetricFamily(
            PREFIX + "num_requests_waiting",
            "Requests queued for admission, suspended ones included",
            value=requests["waiting"],
        )
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of each KV tier's blocks in use (1 = full)",
            labels=["tier"],
        )
        gpu, cpu = cache["gpu_blocks"], cache["cpu_blocks"]
        usage.add_metric(["gpu"], _used(gpu["total"], gpu["free"] + gpu["reclaimable"]))
        usage.add_metric(["cpu"], _used(cpu["total"], cpu["free"]))
        yield usage
        yield CounterMetricFamily(
            PREFIX + "num_preemptions",
            "Requests suspended (swapped out and requeued) for want of GPU blocks",
            value=requests["suspensions"],
        )
        moved = CounterMetricFamily(
            PREFIX + "kv_swap_bytes", "Bytes of KV copied between the tiers", labels=["direction"]
        )
        took = CounterMetricFamily(
            PREFIX + "kv_swap_seconds", "Device seconds the copies took", labels=["direction"]
        )
        for direction in ("in", "out"):
            moved.add_metric([direction], swaps[direction]["bytes"])
            took.add_metric([direction], swaps[direction]["seconds"])
        yield moved
        yield took
        shared = stats["prefix_cache"]
        yield GaugeMetricFamily(
            PREFIX + "kv_shared_chunks",
            "KV chunks used by more than one conversation (a common prefix, held once)",
            value=shared["shared_chunks"],
        )
        yield GaugeMetricFamily(
            PREFIX + "kv_sharing_saved_bytes",
            "Bytes of KV (both tiers) that one copy per conversation of the shared chunks would "
            "take beyond the one copy held",
            value=shared["bytes_saved"],
        )


def _used(total: int, free: int) -> float:
    return (total - free) / total if total else 0.0
