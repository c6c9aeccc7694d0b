"""The scheduler's Prometheus metrics, named as vLLM names its own (`pensieve:` for `vllm:`),
each series labelled with the served `model_name` as vLLM's are, so that a dashboard made for
vLLM reads them with the prefix replaced (`ops/grafana-dashboard.json` is one).

Three kinds, in one `CollectorRegistry` per chat service:

- per turn, updated once when a turn's reply is sent (`observe_turn`, on the store writer's
  thread), from the same request the reply's `usage` is made of, so the counters move by
  exactly what the replies say: prompt tokens by where their KV came from, generated tokens,
  finished requests, and the latency histograms;
- the engine's state and totals (requests running and waiting, KV usage per tier, swaps,
  suspensions), read at scrape time from the stats the engine thread keeps (`follow_engine`),
  so the step loop does no work for them; chunks leaving the tiers are counted from the KV
  events, once per step that has any, and the tokens of each step (`observe_step`);
- the process's (`process_*`: CPU seconds, memory, open files), as prometheus_client has them.

The Prometheus text comes from `exposition`; the HTTP ingress serves it on `/metrics`, and so
does `--metrics-port`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pensieve.actors.scheduler.request import FinishReason, Request
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

# vLLM's: the tokens of a step, at its CUDA graphs' batch sizes
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's 1-2-5 series up to the longest context, for the prompt and reply lengths
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))

EngineStats = Callable[[], dict[str, Any]]  # `ChatService.stats()` as of a recent step


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        """`model_name`: the name the model is served under, on every series."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        model = ["model_name"]

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*model, *labels], registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(PREFIX + name, doc, model, buckets=buckets, registry=r).labels(
                model_name
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.prompt_sources = counter(
            "prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: the GPU tier, the CPU tier, the disk "
            "tier, recomputed from the stored tokens, or new",
            ["source"],
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the KV cache"
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens whose KV was cached (GPU or CPU tier)"
        )
        self.prefix_shared_hits = counter(
            "prefix_cache_shared_hits",
            "Prompt tokens whose KV was found by content in chunks another conversation computed "
            "(of the hits)",
        )
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of finished requests"
        )
        self.success = counter("request_success", "Finished requests", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Time per output token after the first, one sample per request: its decode time "
            "over its output tokens after the first",
            TPOT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between a request's consecutive output tokens, one sample per token",
            TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "End-to-end request latency in the engine",
            LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Time from arrival to first admission", LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Time from first admission to the first token",
            LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "request_decode_time_seconds",
            "Time from the first token to the last",
            LATENCY_BUCKETS,
        )
        self.prompt_lengths = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request", TOKEN_BUCKETS
        )
        self.output_lengths = histogram(
            "request_generation_tokens",
            "Generated tokens of each finished request",
            TOKEN_BUCKETS,
        )
        self.step_tokens = histogram(
            "iteration_tokens_total", "Tokens computed in each engine step", STEP_TOKEN_BUCKETS
        )
        self.chunks = counter(
            "kv_chunks",
            "KV chunks that left a tier: evicted (to the CPU tier) or dropped (from the cache)",
            ["event"],
        )
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        ProcessCollector(registry=r)
        for source in SOURCES:  # every series exists from the start, at 0
            self.prompt_sources.labels(model_name, source)
        for event in ("evicted", "dropped"):
            self.chunks.labels(model_name, event)
        for reason in FinishReason:
            self.success.labels(model_name, reason.value)
        for plain in (
            self.prompt_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.prefix_shared_hits,
            self.generation_tokens,
        ):
            plain.labels(model_name)

    def observe_turn(self, request: Request) -> None:
        """A finished turn whose reply goes out now (any thread)."""
        sources, model = request.sources, self.model_name
        num_prompt, num_output = len(request.prompt_ids), len(request.output_ids)
        self.prompt_tokens.labels(model).inc(num_prompt)
        for source in SOURCES:
            self.prompt_sources.labels(model, source).inc(getattr(sources, source))
        self.prefix_queries.labels(model).inc(num_prompt)
        self.prefix_hits.labels(model).inc(sources.gpu + sources.cpu + sources.disk)
        self.prefix_shared_hits.labels(model).inc(sources.shared)
        self.generation_tokens.labels(model).inc(num_output)
        self.prompt_lengths.observe(num_prompt)
        self.output_lengths.observe(num_output)
        reason = request.finish_reason.value if request.finish_reason else "abort"
        self.success.labels(model, reason).inc()
        for gap in request.token_gaps:
            self.itl.observe(gap)
        first, finish = request.first_token_time, request.finish_time
        if first is not None:
            self.ttft.observe(first - request.arrival)
            if finish is not None:
                self.decode.observe(finish - first)
                if num_output > 1:
                    self.tpot.observe((finish - first) / (num_output - 1))
            if request.admitted_at is not None:
                self.prefill.observe(first - request.admitted_at)
        if finish is not None:
            self.e2e.observe(finish - request.arrival)
        if request.admitted_at is not None:
            self.queue.observe(request.admitted_at - request.arrival)

    def observe_step(self, num_tokens: int) -> None:
        """The tokens an engine step computed, prefill and decode (engine thread)."""
        self.step_tokens.observe(num_tokens)

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
            self.chunks.labels(self.model_name, "evicted").inc(evicted)
        if dropped:
            self.chunks.labels(self.model_name, "dropped").inc(dropped)

    def follow_engine(self, stats: EngineStats) -> None:
        """Report the engine's state and totals from `stats`, read at each scrape."""
        self._engine.stats = stats

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text format (`subjects.METRICS_CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None  # None: no engine thread to read

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        stats = self.stats()
        requests, cache, swaps = stats["requests"], stats["cache"], stats["swaps"]
        model = self.model_name

        def gauge(name: str, doc: str, value: float) -> Metric:
            found = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            found.add_metric([model], value)
            return found

        yield gauge("num_requests_running", "Requests in the batch", requests["running"])
        yield gauge(
            "num_requests_waiting",
            "Requests queued for admission, suspended ones included",
            requests["waiting"],
        )
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of each KV tier's blocks in use (1 = full)",
            labels=["model_name", "tier"],
        )
        gpu, cpu = cache["gpu_blocks"], cache["cpu_blocks"]
        usage.add_metric([model, "gpu"], _used(gpu["total"], gpu["free"] + gpu["reclaimable"]))
        usage.add_metric([model, "cpu"], _used(cpu["total"], cpu["free"]))
        yield usage
        info = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "Information of the KV cache's configuration, in its labels (value 1)",
            labels=[
                "model_name",
                "block_size",
                "num_gpu_blocks",
                "num_cpu_blocks",
                "enable_prefix_caching",
                "policy",
            ],
        )
        sharing = stats["prefix_cache"]["sharing"]
        info.add_metric(
            [
                model,
                str(cache["block_size"]),
                str(gpu["total"]),
                str(cpu["total"]),
                str(bool(sharing)),
                str(stats["policy"]),
            ],
            1,
        )
        yield info
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions",
            "Requests suspended (swapped out and requeued) for want of GPU blocks",
            labels=["model_name"],
        )
        preemptions.add_metric([model], requests["suspensions"])
        yield preemptions
        moved = CounterMetricFamily(
            PREFIX + "kv_swap_bytes",
            "Bytes of KV copied between the tiers",
            labels=["model_name", "direction"],
        )
        took = CounterMetricFamily(
            PREFIX + "kv_swap_seconds",
            "Device seconds the copies took",
            labels=["model_name", "direction"],
        )
        for direction in ("in", "out"):
            moved.add_metric([model, direction], swaps[direction]["bytes"])
            took.add_metric([model, direction], swaps[direction]["seconds"])
        yield moved
        yield took
        shared = stats["prefix_cache"]
        yield gauge(
            "kv_shared_chunks",
            "KV chunks used by more than one conversation (a common prefix, held once)",
            shared["shared_chunks"],
        )
        yield gauge(
            "kv_sharing_saved_bytes",
            "Bytes of KV (both tiers) that one copy per conversation of the shared chunks would "
            "take beyond the one copy held",
            shared["bytes_saved"],
        )


def _used(total: int, free: int) -> float:
    return (total - free) / total if total else 0.0
