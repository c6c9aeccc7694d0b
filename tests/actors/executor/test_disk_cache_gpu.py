"""The disk tier's copies on CUDA beside a step in flight (real files and LMDB in `tmp_path`,
pinned CPU tier, two copy streams as the swap engine has): a save never waits for the device's
compute, yet a GPU block's snapshot holds what the compute before it wrote and not what comes
after; a CPU slot's snapshot holds what a copy stream was still copying into it; a chunk read
back lands in a GPU block after the copy that evicts the block's old contents."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pensieve.actors.executor.disk_cache import DiskCache
from pensieve.actors.executor.disk_views import chunk_geometry, host_blocks
from pensieve.actors.wire.step import DiskLoad, DiskSave
from pensieve.store.disk import DiskConfig, DiskTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS = 3
SHAPE = (6, 2, 32, 2, 64)  # [num_blocks, 2, block_size, Hkv, D]
BUSY_CYCLES = 400_000_000  # a few hundred milliseconds of a kernel that only waits


def open_cache(path: Path) -> tuple[DiskCache, list[torch.Tensor], list[torch.Tensor]]:
    gpu = [torch.zeros(SHAPE, device="cuda") for _ in range(LAYERS)]
    cpu = [host_blocks(SHAPE, torch.float32, pin=True) for _ in range(LAYERS)]
    for layer in cpu:
        layer.zero_()
    geometry = chunk_geometry(cpu)
    tier = DiskTier.open(DiskConfig(path, 8 * geometry.slot_bytes), geometry, "test")
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    return DiskCache(tier, gpu, cpu, 1e9, measure=False, copy_streams=streams), gpu, cpu


def read_into(cache: DiskCache, key: bytes, block: int) -> None:
    handle = cache.read([key])
    assert handle is not None
    assert handle.found() == {key}
    cache.load([DiskLoad(key, block)])
    torch.cuda.synchronize()
    handle.release()


def test_a_gpu_blocks_snapshot_holds_what_compute_wrote_before_it_and_waits_for_none_of_it(
    tmp_path: Path,
) -> None:
    cache, gpu, _ = open_cache(tmp_path)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)  # the step in flight
        for layer in gpu:
            layer[1].fill_(7.0)  # written by that step
        cache.save([DiskSave(None, b"a" * 16, gpu_block=1)])
        # the save left the step running: the host did not wait for the device
        assert not torch.cuda.current_stream().query()
        for layer in gpu:
            layer[1].fill_(-1.0)  # the next step reuses the block
        cache.flush()
        read_into(cache, b"a" * 16, 2)
        assert all(bool((layer[2] == 7.0).all()) for layer in gpu)
    finally:
        cache.close()


def test_a_cpu_slots_snapshot_waits_for_the_copy_into_it_but_not_for_compute(
    tmp_path: Path,
) -> None:
    cache, gpu, cpu = open_cache(tmp_path)
    in_stream, out_stream = cache.copy_streams
    try:
        for layer in gpu:
            layer[3].fill_(5.0)
        out_stream.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(2 * BUSY_CYCLES)  # compute, longer than the copy
        with torch.cuda.stream(out_stream):  # an earlier step's swap-out into slot 0
            torch.cuda._sleep(BUSY_CYCLES // 4)
            for g, c in zip(gpu, cpu, strict=True):
                c[0].copy_(g[3], non_blocking=True)
        cache.save([DiskSave(0, b"b" * 16)])
        assert not torch.cuda.current_stream().query()
        cache.before_overwrite({0})  # this step's copies are about to write the slot
        assert not torch.cuda.current_stream().query()
        for layer in cpu:
            layer[0].fill_(-1.0)  # this step's copies reuse the slot
        cache.flush()
        read_into(cache, b"b" * 16, 4)
        assert all(bool((layer[4] == 5.0).all()) for layer in gpu)
    finally:
        cache.close()


def test_a_chunk_read_back_lands_after_the_copy_evicting_its_blocks_old_contents(
    tmp_path: Path,
) -> None:
    cache, gpu, cpu = open_cache(tmp_path)
    in_stream, _ = cache.copy_streams
    try:
        for layer in cpu:
            layer[1].fill_(3.0)
        cache.save([DiskSave(1, b"c" * 16)])
        cache.flush()
        handle = cache.read([b"c" * 16])
        assert handle is not None and handle.found() == {b"c" * 16}
        for layer in gpu:
            layer[5].fill_(9.0)  # the block's old contents
        in_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(in_stream):  # this step's evict-first copy out of block 5
            torch.cuda._sleep(BUSY_CYCLES)
            for g, c in zip(gpu, cpu, strict=True):
                c[2].copy_(g[5], non_blocking=True)
        cache.load([DiskLoad(b"c" * 16, 5)])
        torch.cuda.synchronize()
        handle.release()
        assert all(bool((layer[2] == 9.0).all()) for layer in cpu)
        assert all(bool((layer[5] == 3.0).all()) for layer in gpu)
    finally:
        cache.close()
