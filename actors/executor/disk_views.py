"""The CPU tier's blocks as the disk tier takes a chunk: one view per layer, in layer order.

A CPU-tier slot's chunk is a block of each layer's [num_blocks, 2, block_size, Hkv, D] tensor;
the views share its memory, so the disk tier writes from and reads into the tier itself. Pinned
blocks start at page boundaries, so where a layer's block is a whole number of pages (most
models) direct I/O moves them with no staging copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pensieve.store.disk import ChunkGeometry


def chunk_geometry(cpu_caches: Sequence[torch.Tensor]) -> ChunkGeometry:
    block = cpu_caches[0][0]  # [2, block_size, Hkv, D]
    return ChunkGeometry(len(cpu_caches), block.numel() * block.element_size())


def chunk_views(cpu_caches: Sequence[torch.Tensor], slot: int) -> list[memoryview]:
    """The bytes of the chunk in CPU slot `slot`, layer after layer (no copy)."""
    return [
        memoryview(cache[slot].view(torch.uint8).numpy().reshape(-1).data) for cache in cpu_caches
    ]
