"""The start-up heap is kept out of Python's garbage collections while serving, and the
benchmark's open loop reports the collector's pauses."""

from __future__ import annotations

import gc

from benchmarks.bench_workload import GcPauses
from pensieve.ops.factory import frozen_heap


def test_the_start_up_heap_is_frozen_while_serving_and_collectable_after() -> None:
    loaded = [[i] for i in range(1000)]  # stands for the model and compiled kernels
    before = gc.get_freeze_count()
    with frozen_heap() as seconds:
        assert seconds >= 0.0
        assert gc.get_freeze_count() >= before + len(loaded)  # out of every later collection
        cycle: list[object] = []
        cycle.append(cycle)  # garbage made while serving is still collected
        del cycle
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0  # a replay inside a test process keeps no garbage


def test_the_collectors_pauses_are_counted_by_generation() -> None:
    with GcPauses() as pauses:
        gc.collect()  # one full collection
        gc.collect(0)
    summary = pauses.summary()
    assert summary["collections"][2] >= 1 and summary["collections"][0] >= 1
    assert summary["seconds"] > 0.0 and summary["full_max_ms"] > 0.0
    gc.collect()
    assert pauses.summary() == summary  # no longer listening once left
