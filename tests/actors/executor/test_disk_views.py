"""CPU-tier blocks to the disk tier and back, through views of the tier's own tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pensieve.actors.executor.disk_views import chunk_geometry, chunk_views, host_blocks
from pensieve.store.disk import DiskConfig, DiskTier, IoMethod
from pensieve.store.disk.slot_io import is_aligned

SHAPE = (8, 2, 32, 3, 64)  # [num_blocks, 2, block_size, Hkv, D]: SmolLM2-135M's per layer


def cpu_tier(pin: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(4):
        # allocated as the executor's CPU tier is (`ModelRunner`), then filled
        cache = host_blocks(SHAPE, torch.bfloat16, pin)
        caches.append(cache.copy_(torch.randn(SHAPE, generator=generator)))
    return caches


def round_trip(tmp_path: Path, caches: list[torch.Tensor], method: IoMethod) -> DiskTier:
    """Blocks 1, 5, 7 to disk, then back into blocks 2, 5, 0; checks they come back equal."""
    geometry = chunk_geometry(caches)
    assert geometry.chunk_bytes == 4 * 2 * 32 * 3 * 64 * 2
    tier = DiskTier.open(DiskConfig(tmp_path, 16 * geometry.slot_bytes, method), geometry, "m")
    keys = [bytes([n]) * 16 for n in (1, 5, 7)]
    saved = [torch.stack([cache[n] for cache in caches]) for n in (1, 5, 7)]
    written = tier.write(
        [(key, chunk_views(caches, n)) for key, n in zip(keys, (1, 5, 7), strict=True)]
    )
    assert written == keys
    for cache in caches:
        cache.zero_()
    found = tier.read(
        [(key, chunk_views(caches, n)) for key, n in zip(keys, (2, 5, 0), strict=True)]
    )
    assert found == [True] * 3
    for blocks, n in zip(saved, (2, 5, 0), strict=True):
        assert torch.equal(torch.stack([cache[n] for cache in caches]), blocks)
    return tier


@pytest.mark.parametrize("method", [IoMethod.AUTO, IoMethod.BUFFERED])
def test_cpu_tier_blocks_go_to_disk_and_back_through_views(
    tmp_path: Path, method: IoMethod
) -> None:
    round_trip(tmp_path, cpu_tier(pin=False), method).close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA GPU")
def test_pinned_blocks_move_by_direct_io_with_no_staging(tmp_path: Path) -> None:
    caches = cpu_tier(pin=True)
    assert all(is_aligned(chunk_views(caches, n)) for n in range(SHAPE[0]))
    tier = round_trip(tmp_path, caches, IoMethod.AUTO)
    tier.close()
