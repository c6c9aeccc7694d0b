"""The Prometheus metrics of a served engine, scraped while real conversations run through the
OpenAI API and parsed with prometheus_client's own parser: the counters move by exactly what
the replies' `usage` says, and the scheduler's metrics read the same on the HTTP port, on
`--metrics-port` and over the bus (an HTTP ingress in another process)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from pensieve.actors.ingress.http_actor import HttpConfig, HttpIngressActor
from pensieve.actors.wire.bus import Bus
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats, free_port
from pensieve.ops.sharegpt import human_turns, load_conversations
from tests.ops.serving import Samples, scrape, serve_on_thread, value

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
SOURCES = ("gpu", "cpu", "recomputed", "new")


@pytest.fixture(scope="module")
def served(smollm2, smollm2_chat, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A served engine with small tiers (its history swaps and is dropped), the HTTP ingress
    and a metrics port, on a nats-server without accounts."""
    data_dir = tmp_path_factory.mktemp("data")
    options = EngineOptions(
        model="smollm2",
        max_batch_tokens=512,
        gpu_cache_tokens=256,
        cpu_cache_tokens=256,
        admission_reserve=0.0,
    )
    built = assemble(options, smollm2, smollm2_chat)
    http, metrics = free_port(), free_port()
    with (
        EmbeddedNats() as nats_server,
        serve_on_thread(
            built,
            data_dir,
            nats_server.url,
            http=HttpConfig(http, model="smollm2"),
            metrics_port=metrics,
        ) as (engine_id, _),
    ):
        yield {
            "http": f"http://127.0.0.1:{http}",
            "metrics": f"http://127.0.0.1:{metrics}",
            "nats": nats_server.url,
            "engine_id": engine_id,
        }


async def converse(api: AsyncOpenAI, messages: list[str], usages: list[Any]) -> None:
    """One conversation, each turn streamed, naming the conversation after the first."""
    conv_id = None
    for message in messages:
        raw = await api.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=[{"role": "user", "content": message}],
            stream=True,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **({"conversation_id": conv_id} if conv_id else {})},
        )
        conv_id = raw.headers["X-Conversation-Id"]
        stream = raw.parse()
        if inspect.isawaitable(stream):  # openai 1.x: a coroutine
            stream = await stream
        async for chunk in stream:
            if chunk.usage is not None:
                usages.append(chunk.usage)


def test_counters_move_by_exactly_what_the_replies_usage_says(served, sharegpt20) -> None:
    chats = [[t.text for t in human_turns(c)][:2] for c in load_conversations(sharegpt20)[:4]]
    url = served["http"] + "/metrics"
    before = scrape(url)
    usages: list[Any] = []
    during: list[Samples] = []

    async def load() -> None:
        api = AsyncOpenAI(base_url=served["http"] + "/v1", api_key="none", max_retries=0)
        talking = asyncio.gather(*(converse(api, chat, usages) for chat in chats))
        while not talking.done():  # scraped and parsed while the turns run
            during.append(await asyncio.to_thread(scrape, url))
            await asyncio.sleep(0.1)
        await talking
        await api.close()

    asyncio.run(load())
    after = scrape(url)
    turns = sum(len(chat) for chat in chats)
    assert len(usages) == turns and len(during) > 1

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert moved("generation_tokens_total") == turns * MAX_TOKENS
    sources = Counter[str]()
    for u in usages:
        sources.update(u.prompt_tokens_details.model_extra["prompt_sources"])
    for source in SOURCES:
        assert moved("prompt_tokens_by_source_total", source=source) == sources[source]
    assert sources["gpu"] + sources["cpu"] > 0  # second turns hit the cache
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert moved("prefix_cache_hits_total") == cached
    assert value(after, "request_success_total", finished_reason="length") == turns
    for histogram in (
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert moved(f"{histogram}_count") == turns
        assert moved(f"{histogram}_sum") > 0 or histogram == "request_queue_time_seconds"
    # the engine's state: busy while the turns ran, idle after; its tiers full of history
    assert max(value(s, "num_requests_running") for s in during) >= 1
    assert value(after, "num_requests_running") == 0 == value(after, "num_requests_waiting")
    assert 0 < value(after, "kv_cache_usage_perc", tier="gpu") <= 1
    assert moved("kv_swap_bytes_total", direction="out") > 0
    assert moved("kv_chunks_total", event="evicted") > 0
    for samples in (*during, after):  # counters only grow
        assert value(samples, "prompt_tokens_total") >= value(before, "prompt_tokens_total")


def test_the_metrics_read_the_same_on_every_way_out(served) -> None:
    """The HTTP port, --metrics-port, and an HTTP ingress of another process, which asks the
    scheduler over the bus."""

    async def from_the_bus() -> Samples:
        bus = await Bus.connect(served["nats"])
        actor = HttpIngressActor(bus, served["engine_id"], HttpConfig(0), lambda key: None)
        async with actor:
            return await asyncio.to_thread(scrape, f"http://127.0.0.1:{actor.port}/metrics")

    counters = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_hits_total")
    got = [
        scrape(served["http"] + "/metrics"),
        scrape(served["metrics"] + "/metrics"),
        asyncio.run(from_the_bus()),
    ]
    for name in counters:
        assert len({value(samples, name) for samples in got}) == 1, name


def test_every_series_has_vllms_name_and_the_model_name(served, sharegpt20) -> None:
    """vLLM's series, as a dashboard made for it asks for them (`pensieve:` for `vllm:`), each
    with the served model's name; the TPOT histogram named for its one sample per request
    beside the inter-token latency's one per token; and the process's own."""
    chats = [[t.text for t in human_turns(c)][:2] for c in load_conversations(sharegpt20)[4:6]]
    url = served["http"] + "/metrics"
    before = scrape(url)
    usages: list[Any] = []

    async def load() -> None:
        api = AsyncOpenAI(base_url=served["http"] + "/v1", api_key="none", max_retries=0)
        await asyncio.gather(*(converse(api, chat, usages) for chat in chats))
        await api.close()

    asyncio.run(load())
    after = scrape(url)
    turns = len(usages)
    assert turns == 4

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    ours = [(name, dict(labels)) for name, labels in after if name.startswith("pensieve:")]
    assert ours and all(labels.get("model_name") == "smollm2" for _, labels in ours), [
        name for name, labels in ours if labels.get("model_name") != "smollm2"
    ]
    # one gap between each two of a reply's tokens
    assert moved("inter_token_latency_seconds_count") == turns * (MAX_TOKENS - 1)
    assert moved("request_time_per_output_token_seconds_count") == turns
    assert not any(name.startswith("pensieve:time_per_output_token") for name, _ in ours)
    assert moved("request_prompt_tokens_count") == turns
    assert moved("request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert moved("request_generation_tokens_sum") == turns * MAX_TOKENS
    for phase in ("prefill", "decode"):
        assert moved(f"request_{phase}_time_seconds_count") == turns
        assert moved(f"request_{phase}_time_seconds_sum") > 0
    # each step's tokens: every reply token after the first is fed back in a step, and each
    # prompt's uncached tokens are computed
    new = sum(u.prompt_tokens - u.prompt_tokens_details.cached_tokens for u in usages)
    assert moved("iteration_tokens_total_sum") >= turns * (MAX_TOKENS - 1) + new
    assert moved("iteration_tokens_total_count") >= MAX_TOKENS
    ((labels, info),) = [
        (dict(labels), v) for (name, labels), v in after.items() if name.endswith("config_info")
    ]
    assert info == 1 and int(labels["block_size"]) > 0 and int(labels["num_gpu_blocks"]) > 0
    assert {"num_cpu_blocks", "enable_prefix_caching"} <= labels.keys()
    assert after[("process_cpu_seconds_total", ())] > 0
    assert after[("process_resident_memory_bytes", ())] > 0


DASHBOARD = Path(__file__).resolve().parents[2] / "ops/grafana/pensieve-dashboard.json"
# a series name in PromQL: not a function, keyword or label (those are followed by `(`, or
# sit inside braces or after `by`)
SERIES = re.compile(r"\b((?:pensieve:|process_)[a-z0-9_:]+)")


def test_the_grafana_dashboard_asks_only_for_series_a_scrape_has(served) -> None:
    """The dashboard loads as Grafana's JSON model (its required keys, one panel per id, each
    query a PromQL expression on the provisioned data source), and every series its queries
    and variables name is in a real scrape of a served engine."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert {"uid", "title", "schemaVersion", "panels", "templating"} <= dashboard.keys()
    assert isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    queries = [v["definition"] for v in dashboard["templating"]["list"]]
    for panel in panels:
        assert panel["type"] in {"timeseries", "heatmap", "table", "stat", "gauge"}
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["targets"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        queries += [target["expr"] for target in panel["targets"]]
    samples = {name for name, _ in scrape(served["http"] + "/metrics")}
    named = set()
    for query in queries:
        found = SERIES.findall(query)
        assert found, f"names no series: {query}"
        named.update(found)
    assert not named - samples, sorted(named - samples)
    for wanted in ("inter_token_latency_seconds", "request_prefill_time_seconds", "cache_config"):
        assert any(wanted in name for name in named), wanted
