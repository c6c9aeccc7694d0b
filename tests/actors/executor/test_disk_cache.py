"""The executor's disk tier in service, on real files and LMDB in `tmp_path` (CPU tensors as both
tiers): a chunk saved from a CPU slot comes back into a GPU block byte for byte, also after the
tier is reopened; the budget is a hard bound, with room made by the removals ordered before a
save; a chunk not on disk is not found."""

from __future__ import annotations

from pathlib import Path

import torch

from pensieve.actors.executor.disk_cache import DiskCache
from pensieve.actors.executor.disk_views import chunk_geometry
from pensieve.actors.wire.step import DiskLoad, DiskSave
from pensieve.store.disk import DiskConfig, DiskTier

LAYERS, SLOTS = 3, 6
SHAPE = (SLOTS, 2, 32, 2, 16)  # [num_blocks, 2, block_size, Hkv, D]: 8 KiB a layer's block


def tiers() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    return [torch.zeros(SHAPE) for _ in range(LAYERS)], [torch.randn(SHAPE) for _ in range(LAYERS)]


def open_cache(path: Path, gpu, cpu, num_chunks: int = 4, measure: bool = False) -> DiskCache:
    geometry = chunk_geometry(cpu)
    tier = DiskTier.open(DiskConfig(path, num_chunks * geometry.slot_bytes), geometry, "test")
    return DiskCache(tier, gpu, cpu, read_bytes_per_s=1e9, measure=measure)


def key(i: int) -> bytes:
    return bytes([i]) * 16


def read(cache: DiskCache, keys: list[bytes]) -> frozenset[bytes]:
    handle = cache.read(keys)
    if handle is None:
        return frozenset()
    found = handle.found()
    handle.release()
    return found


def test_a_saved_chunk_loads_into_a_gpu_block_byte_for_byte_also_after_a_reopen(
    tmp_path,
) -> None:
    gpu, cpu = tiers()
    cache = open_cache(tmp_path, gpu, cpu)
    cache.save([DiskSave(1, key(1)), DiskSave(4, key(4))])
    cache.before_overwrite({1, 3})  # as the runner does before a step's copies write slots
    for layer in cpu:  # the step's copies reuse the slot at once: the saved bytes are kept
        layer[1].zero_()
    cache.flush()
    assert cache.tier.num_chunks == 2
    handle = cache.read([key(4), key(1), key(9)])
    assert handle is not None and handle.found() == {key(1), key(4)}
    cache.load([DiskLoad(key(4), 0), DiskLoad(key(1), 5)])
    handle.release()
    expected = tiers()[1]
    for layer, want in zip(gpu, expected, strict=True):
        assert torch.equal(layer[0], want[4]) and torch.equal(layer[5], want[1])
    cache.close()
    gpu, cpu = tiers()
    again = open_cache(tmp_path, gpu, cpu)  # a restart: the chunks are found by key
    assert read(again, [key(1), key(4)]) == {key(1), key(4)}
    assert again.read([key(2)]) is None
    again.close()


def test_the_budget_is_a_hard_bound_and_removals_ordered_first_make_room(tmp_path) -> None:
    gpu, cpu = tiers()
    cache = open_cache(tmp_path, gpu, cpu, num_chunks=3)
    cache.save([DiskSave(slot, key(slot)) for slot in range(3)])
    cache.flush()
    cache.save([DiskSave(3, key(3))])  # no free slot, and nothing removed for it: not written
    cache.flush()
    assert set(cache.tier.keys()) == {key(0), key(1), key(2)}
    for layer in gpu:
        layer[4].normal_()
    cache.drop([key(1)])  # as a step's orders: the removal, then the save in its place
    cache.save([DiskSave(None, key(9), gpu_block=4)])  # from a GPU block
    cache.flush()
    assert cache.tier.num_chunks == 3
    assert set(cache.tier.keys()) == {key(0), key(2), key(9)}
    assert (tmp_path / "slots.bin").stat().st_size == 3 * cache.tier.geometry.slot_bytes
    handle = cache.read([key(9)])
    assert handle is not None and handle.found() == {key(9)}
    cache.load([DiskLoad(key(9), 0)])
    handle.release()
    assert all(torch.equal(layer[0], layer[4]) and layer[4].any() for layer in gpu)
    cache.close()


def test_a_corrupt_chunk_is_not_found(tmp_path) -> None:
    gpu, cpu = tiers()
    cache = open_cache(tmp_path, gpu, cpu)
    cache.save([DiskSave(2, key(2))])
    cache.close()
    slots = tmp_path / "slots.bin"
    data = bytearray(slots.read_bytes())
    data[100] ^= 0xFF
    slots.write_bytes(bytes(data))
    again = open_cache(tmp_path, *tiers())
    assert read(again, [key(2)]) == frozenset()
    assert again.tier.num_chunks == 0  # its entry is dropped
    again.close()


def test_the_read_rate_that_weighs_reading_against_recomputing_is_measured(tmp_path) -> None:
    """Without a rate given, the first guess stands until the tier reads; then its own reads set
    the rate. A rate given stands."""
    gpu, cpu = tiers()
    for folder in ("fixed", "measured"):
        (tmp_path / folder).mkdir()
    fixed = open_cache(tmp_path / "fixed", gpu, cpu)
    fixed.save([DiskSave(0, key(0))])
    fixed.flush()
    assert read(fixed, [key(0)]) == {key(0)}
    assert fixed.read_bytes_per_s == 1e9
    fixed.close()
    cache = open_cache(tmp_path / "measured", gpu, cpu, measure=True)
    cache.read_bytes_per_s = 1e18  # a guess no disk reaches
    assert cache.read([key(0)]) is None  # nothing on disk: nothing read, nothing measured
    assert cache.read_bytes_per_s == 1e18
    cache.save([DiskSave(slot, key(slot)) for slot in range(3)])
    cache.flush()
    assert read(cache, [key(0), key(1), key(2)]) == {key(0), key(1), key(2)}
    assert 0 < cache.read_bytes_per_s < 1e15
    chunk_bytes = cache.tier.geometry.chunk_bytes
    assert cache.read_seconds_per_chunk == chunk_bytes / cache.read_bytes_per_s
    cache.close()
