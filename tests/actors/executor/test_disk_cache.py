"""The executor's disk tier in service, on real files and LMDB in `tmp_path` (CPU tensors as both
tiers): a chunk saved from a CPU slot comes back into a GPU block byte for byte, also after the
tier is reopened; the budget evicts the least recently used; a chunk not on disk is not found."""

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


def open_cache(path: Path, gpu, cpu, num_chunks: int = 4) -> DiskCache:
    geometry = chunk_geometry(cpu)
    tier = DiskTier.open(DiskConfig(path, num_chunks * geometry.slot_bytes), geometry, "test")
    return DiskCache(tier, gpu, cpu, read_bytes_per_s=1e9)


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
    for layer in cpu:  # the step's copies reuse the slots at once: the saved bytes are kept
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


def test_the_budget_keeps_the_chunks_used_last(tmp_path) -> None:
    gpu, cpu = tiers()
    cache = open_cache(tmp_path, gpu, cpu, num_chunks=3)
    cache.save([DiskSave(slot, key(slot)) for slot in range(3)])
    cache.flush()
    assert read(cache, [key(0)]) == {key(0)}  # 0 used again: 1 is now the least recent
    cache.save([DiskSave(3, key(3)), DiskSave(4, key(4))])
    cache.flush()
    assert cache.tier.num_chunks == 3
    assert set(cache.tier.keys()) == {key(0), key(3), key(4)}
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
