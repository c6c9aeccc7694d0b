"""The chunk counters of the scheduler's metrics, fed a real cache manager's KV events."""

from __future__ import annotations

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.scheduler.metrics import Metrics
from pensieve.actors.wire.messages import KvEventKind


def test_a_shared_chunk_swapped_out_counts_once() -> None:
    config = CacheConfig(4, 12, 8, Policy.PENSIEVE, swap_out_threshold=0.99)
    kv = KVCacheManager(config, cost=lambda context: 1.0 + context / 100)
    kv.take_events()
    prompt = list(range(12))  # three full chunks, both conversations' first
    for conv_id, own in (("a", [90, 91]), ("b", [80, 81])):
        conv = kv.conversation(conv_id, 0.0)
        kv.lookup(conv, prompt)
        kv.acquire(conv, 14, 0.0)
        conv.num_positions = 14
        kv.release(conv, 0.0, prompt + own)
    assert kv.num_shared_chunks == 3
    kv.take_events()
    kv.swap_out_ahead(10.0)  # every chunk: the three shared ones and each one's last
    events = kv.take_events()
    assert [e.kind for e in events].count(KvEventKind.SWAPPED_OUT) == 3 * 2 + 2
    metrics = Metrics()
    metrics.count_kv_events(events)
    evicted = {"model_name": "", "event": "evicted"}
    assert metrics.registry.get_sample_value("pensieve:kv_chunks_total", evicted) == 5
