"""The block-copy kernel moves exactly the blocks it is told to (CPU: Triton interpreter)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pensieve.kernels.block_copy import copy_blocks


@pytest.mark.parametrize("max_programs", [None, 1, 3])
def test_scattered_blocks_land_where_asked_and_nothing_else_changes(max_programs: int | None):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # [blocks, K/V, page, heads, dim]: 3 tiles per block, the last one partial
    src = torch.randn(12, 2, 8, 34, 16)
    dst = torch.full((20, 2, 8, 34, 16), float("nan"))
    src_ids = rng.sample(range(12), 7)
    dst_ids = rng.sample(range(20), 7)
    copy_blocks(
        src,
        dst,
        torch.tensor(src_ids, dtype=torch.int32),
        torch.tensor(dst_ids, dtype=torch.int32),
        max_programs,  # a capped grid walks the (block, tile) pairs with a stride
    )
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[d], src[s]), f"seed {seed}: block {s} -> {d}"
    untouched = [i for i in range(20) if i not in dst_ids]
    assert torch.isnan(dst[untouched]).all(), (
        f"seed {seed}: a block was written that was not asked for"
    )
