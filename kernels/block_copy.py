"""Copy scattered KV blocks between the GPU tier and pinned host memory in one launch.

A block of one layer is ~160 KB; one DMA copy per block spends about as long being issued as
moving bytes, so scattered swaps reach only half the PCIe rate. This kernel instead reads and
writes pinned host memory directly (zero-copy through unified addressing) for any number of
blocks per launch.

The copy shares the GPU with the step it overlaps, and a program waiting on PCIe still holds
its SM slot: a grid of one program per (block, tile) slows a large decode step running beside it
by ~20%. So the grid is capped (`max_programs`) and each program walks the (block, tile) pairs
with a stride: a handful of programs still keep PCIe busy and cost the step about half as much.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096


# the batch size is not specialized on (the block size, fixed per model, is: its alignment lets
# loads vectorize): every batch then runs the kernel compiled at start-up
@triton.jit(do_not_specialize=["num_work"])
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_index_ptr,
    dst_index_ptr,
    block_numel,
    num_work,
    tiles_per_block,
    TILE: tl.constexpr,
):
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        op = work // tiles_per_block
        part = work % tiles_per_block
        src_block = tl.load(src_index_ptr + op).to(tl.int64)
        dst_block = tl.load(dst_index_ptr + op).to(tl.int64)
        offsets = part * TILE + tl.arange(0, TILE)
        mask = offsets < block_numel
        values = tl.load(src_ptr + src_block * block_numel + offsets, mask=mask)
        tl.store(dst_ptr + dst_block * block_numel + offsets, values, mask=mask)


def copy_blocks(
    src: torch.Tensor,  # [num_src_blocks, ...] contiguous (device or pinned host)
    dst: torch.Tensor,  # [num_dst_blocks, ...] same block shape and dtype
    src_index: torch.Tensor,  # [N] int32 on the device
    dst_index: torch.Tensor,  # [N] int32 on the device
    max_programs: int | None = None,  # cap on the grid; None: one program per (block, tile)
) -> None:
    """dst[dst_index[i]] = src[src_index[i]] for every i, on the current stream."""
    num = src_index.numel()
    if num == 0:
        return
    block_numel = src[0].numel()
    tiles = triton.cdiv(block_numel, TILE)
    work = num * tiles
    grid = (work if max_programs is None else max(1, min(work, max_programs)),)
    _copy_blocks_kernel[grid](src, dst, src_index, dst_index, block_numel, work, tiles, TILE=TILE)
