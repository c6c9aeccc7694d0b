"""The CPU tier's blocks as the disk tier takes a chunk: one view per layer, in layer order.

A CPU-tier slot's chunk is a block of each layer's [num_blocks, 2, block_size, Hkv, D] tensor;
the views share its memory, so the disk tier writes from and reads into the tier itself. The
pinned tier is allocated at a page boundary (`host_blocks`), so where a layer's block is a whole
number of pages (most models) direct I/O moves them with no staging copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pensieve.store.disk import ALIGN, ChunkGeometry


def host_blocks(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory for KV blocks; pinned memory starts at a page boundary. (The pinned
    allocator gives large allocations whole pages, but may place a small one inside a page.)"""
    if not pin:
        return torch.empty(tuple(shape), dtype=dtype)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(num_bytes + ALIGN, dtype=torch.uint8, pin_memory=True)
    start = -raw.data_ptr() % ALIGN
    return raw[start : start + num_bytes].view(dtype).view(tuple(shape))


def chunk_geometry(cpu_caches: Sequence[torch.Tensor]) -> ChunkGeometry:
    block = cpu_caches[0][0]  # [2, block_size, Hkv, D]
    return ChunkGeometry(len(cpu_caches), block.numel() * block.element_size())


def chunk_views(cpu_caches: Sequence[torch.Tensor], slot: int) -> list[memoryview]:
    """The bytes of the chunk in CPU slot `slot`, layer after layer (no copy)."""
    return [
        memoryview(cache[slot].view(torch.uint8).numpy().reshape(-1).data) for cache in cpu_caches
    ]
