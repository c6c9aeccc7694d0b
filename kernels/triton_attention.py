"""Paged multi-token attention in Triton: one kernel for decode, prefill and everything between.

The contract is metadata.py's; reference.py computes the same function in torch. The kernels, and
how a program maps to query tokens, heads and KV positions, are in attention_kernels.py; here is
how a launch is shaped (tile sizes, KV splits) and issued."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

from pensieve.kernels.attention_kernels import (
    _merge_splits_kernel,
    _paged_attention_kernel,
    _write_kv_kernel,
)
from pensieve.kernels.launch import FastKernel
from pensieve.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernel works in base 2
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SMEM_LIMIT = 228 * 1024  # shared memory per SM on Hopper
_DECODE_ROWS = 64  # query rows (tokens x group) up to which a launch takes decode tiles
_DECODE_SPLITS = 64  # KV splits of less than 512 positions a launch of decodes takes, at most


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the attention kernel. kv_split_len=None: one program covers all of KV."""

    block_m: int  # rows per tile: query tokens x group heads (a power of two, >= 16)
    block_n: int  # KV positions per inner step (a power of two, >= 16)
    num_warps: int
    num_stages: int
    kv_split_len: int | None = None  # KV positions per split, a multiple of block_n

    def num_splits(self, max_seq_len: int) -> int:
        """The KV splits a launch of this shape makes for contexts up to `max_seq_len`."""
        return 1 if self.kv_split_len is None else triton.cdiv(max_seq_len, self.kv_split_len)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small, so that CPU tests also take the split-KV path
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@functools.lru_cache(maxsize=256)
def choose_config(
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    num_sms: int,
) -> KernelConfig:
    """Tile shape and KV split for one step; cached, so every layer after the first reuses it.

    Tile shapes are the fastest of a sweep on Hopper (`bench_kernels.py --sweep`): decode and
    short multi-token steps want 16-32 rows, 64-position KV tiles and 2 stages; prefill wants
    128 x 128 tiles, 8 warps, 3 stages (bf16; fp32 takes smaller tiles to fit shared memory).
    """
    rows = max_query_len * group
    min_m = max(16, triton.next_power_of_2(group))
    if rows <= _DECODE_ROWS:  # decode and short multi-token steps: memory-bound
        block_m = max(min_m, triton.next_power_of_2(rows))
        config = KernelConfig(block_m, 64, num_warps=4, num_stages=2)
    elif head_dim >= 256:
        config = KernelConfig(max(min_m, 64), 32, num_warps=4, num_stages=2)
    elif elem_bytes > 2:
        config = KernelConfig(max(min_m, 128), 64, num_warps=8, num_stages=2)
    else:
        config = KernelConfig(max(min_m, 128), 128, num_warps=8, num_stages=3)
    row_bytes = head_dim * elem_bytes
    while _smem_bytes(config, row_bytes) > _SMEM_LIMIT and config.block_n > 16:
        config = dataclasses.replace(config, block_n=config.block_n // 2)
    num_splits = _num_kv_splits(
        config, num_tokens, num_seqs, max_query_len, group, num_kv_heads, row_bytes, num_sms
    )
    # a split below 512 positions costs more, except in a launch of decodes short of filling
    # the GPU: there each program only streams its KV, and up to _DECODE_SPLITS splits of 2
    # tiles are the fastest (`bench_kernels.py --splits`: one decode at 4k, 14 us a layer in 32
    # splits, 21 in 8)
    most = max_seq_len // 512
    if max_query_len == 1:
        most = max(most, min(_DECODE_SPLITS, max_seq_len // (2 * config.block_n)))
    num_splits = min(num_splits, most)
    if num_splits <= 1:
        return config
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), config.block_n) * config.block_n
    return KernelConfig(
        config.block_m, config.block_n, config.num_warps, config.num_stages, split_len
    )


def _smem_bytes(config: KernelConfig, row_bytes: int) -> int:
    # K and V tiles per pipeline stage, plus the query tile
    return (config.num_stages * 2 * config.block_n + config.block_m) * row_bytes


def _num_kv_splits(
    config: KernelConfig,
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    group: int,
    num_kv_heads: int,
    row_bytes: int,
    num_sms: int,
) -> int:
    """KV splits that keep the grid from ending in a ragged wave.

    A grid of 1-2 waves of resident programs loses up to 20% to its tail, so it is split until
    it spans at least 3 waves. A grid of less than one wave is split into as many as fit in it;
    a launch of decodes (one query row a head in each tile, so each program only streams its
    KV) into as many as fill it: rounded up, where multi-token tiles round down (measured on
    an H200 from CUDA graphs, `bench_kernels.py --splits`: decodes of 40 sequences over 5 KV
    heads take 46 us in 2 splits against 53 in 1; 32 sequences of 8 tokens over 10 heads, 53 us
    in 1 against 69 in 2).
    """
    block_q = config.block_m // group
    num_tiles = min(
        num_seqs * triton.cdiv(max_query_len, block_q), num_tokens // block_q + num_seqs
    )
    num_programs = num_tiles * num_kv_heads
    resident = _SMEM_LIMIT // _smem_bytes(config, row_bytes)
    slots = num_sms * max(1, min(4, resident))  # programs resident at once
    if num_programs >= slots:
        return triton.cdiv(3 * slots, num_programs)
    if max_query_len == 1:
        return triton.cdiv(slots, num_programs)
    return slots // num_programs


def launch_config(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> KernelConfig:
    """The launch shape paged_attention_triton picks for these inputs."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    return choose_config(
        num_tokens,
        meta.num_seqs,
        meta.max_query_len,
        meta.max_seq_len,
        num_q_heads // num_kv_heads,
        num_kv_heads,
        head_dim,
        query.element_size(),
        _num_sms(query.device),
    )


def compile_variants(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_context: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Compile every kernel variant a run with contexts up to `max_context` can launch: each
    tile shape `choose_config` picks, unsplit and split, for multi-token queries and (the shape
    picked for one query token) for decodes, and the merge kernel for each power of two of
    splits. Triton compiles a variant on its first launch, which takes ~1 s: met in the middle
    of serving, that stalls every running request. Returns the launches made."""
    group = num_q_heads // num_kv_heads
    elem = torch.empty(0, dtype=dtype).element_size()
    sms = _num_sms(device)
    shapes = {
        (
            dataclasses.replace(
                choose_config(q, 1, q, max(q, 1024), group, num_kv_heads, head_dim, elem, sms),
                kv_split_len=None,
            ),
            single,
        )
        for q in (1, 2, 4, 8, 16, 32, 2048)
        for single in ((True, False) if q == 1 else (False,))
    }
    shortest = 2 * min(config.block_n for config, _ in shapes)  # a decode's shortest split
    most_splits = max(2, max_context // 512, min(_DECODE_SPLITS, max_context // shortest))
    split_counts = [2]
    while split_counts[-1] < most_splits:
        split_counts.append(split_counts[-1] * 2)
    launches = 0
    for config, single in sorted(shapes, key=lambda c: (c[0].block_m, c[0].block_n, c[1])):
        for splits in (1, *split_counts):
            context = splits * config.block_n
            blocks = -(-context // block_size)
            cache = torch.zeros(
                (blocks, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
            )
            query_len = 1 if single else min(max(2, config.block_m // group), context)
            query = torch.zeros((query_len, num_q_heads, head_dim), dtype=dtype, device=device)
            meta = AttentionMetadata(
                cu_query_lens=torch.tensor([0, query_len], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([context], dtype=torch.int32, device=device),
                block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
                slot_mapping=torch.arange(query_len, dtype=torch.long, device=device),
                max_query_len=query_len,
                max_seq_len=context,
                block_size=block_size,
                query_lens_host=(query_len,),
                seq_lens_host=(context,),
            )
            split_len = None if splits == 1 else config.block_n
            launch = dataclasses.replace(config, kv_split_len=split_len)
            paged_attention_triton(query, cache, meta, 1.0, config=launch)
            launches += 1
    return launches


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Store each token's K and V at its slot (block * block_size + offset) of the paged cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(f"shapes disagree: key {key.shape} value {value.shape} {kv_cache.shape}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("the last dimension of key, value and kv_cache must be contiguous")
    if num_tokens == 0:
        return
    _WRITE_KV(
        (num_tokens,),
        key,
        value,
        kv_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        PAGE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        HEADS=triton.next_power_of_2(num_kv_heads),
    )


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    head_dim = query.shape[2]
    if query.dtype not in _DTYPES or kv_cache.dtype != query.dtype:
        raise ValueError(f"dtypes: query {query.dtype}, kv_cache {kv_cache.dtype}")
    if head_dim < 16 or head_dim & (head_dim - 1) or kv_cache.shape[4] != head_dim:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if query.shape[1] % kv_cache.shape[3]:
        raise ValueError("query heads must be a multiple of KV heads")
    if kv_cache.shape[2] != meta.block_size:
        raise ValueError(f"cache pages of {kv_cache.shape[2]} but metadata says {meta.block_size}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("the last dimension of query and kv_cache must be contiguous")


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, Hq, D]; allocated when None
    config: KernelConfig | None = None,  # None: choose_config's pick
) -> torch.Tensor:
    """Causal attention of every query token over its sub-sequence's paged KV (see metadata.py)."""
    if out is None:
        out = torch.empty_like(query)
    return AttentionPlan(query, kv_cache, meta, scale, out=out, config=config).run(
        query, kv_cache, out
    )


class AttentionPlan:
    """The launches of `paged_attention_triton` for one step, worked out once: the tile shapes,
    grids, split buffers and every scalar argument are the same in every layer of a step, so
    `run` only swaps in the layer's query, cache and output (which must have the planned shapes
    and strides). A mixed step attends in two launches (see `AttentionMetadata.split_singles`)."""

    def __init__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        out: torch.Tensor | None = None,  # its strides are planned for; query's when None
        config: KernelConfig | None = None,
    ) -> None:
        _check_inputs(query, kv_cache, meta)
        self.query_layout = (query.shape, query.stride(), query.dtype)
        self.out_stride = query.stride() if out is None else out.stride()
        self.cache_layout = (kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        num_tokens = query.shape[0]
        parts = meta.split_singles() if config is None else None
        group = query.shape[1] // kv_cache.shape[3]
        self.launches: list[_Launch] = []
        if num_tokens == 0:
            return
        if parts is not None and meta.max_query_len * group > _DECODE_ROWS:
            singles, rest = parts  # decodes first, on decode tiles; then the multi-token rest
            n = singles.num_seqs
            self.launches.append(_Launch(query, kv_cache, singles, scale, 0, n, self.out_stride))
            self.launches.append(
                _Launch(query, kv_cache, rest, scale, n, num_tokens, self.out_stride)
            )
        else:
            self.launches.append(
                _Launch(query, kv_cache, meta, scale, 0, num_tokens, self.out_stride, config)
            )

    def run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        planned = (self.query_layout, self.cache_layout)
        given = (
            (query.shape, query.stride(), query.dtype),
            (kv_cache.shape, kv_cache.stride(), kv_cache.dtype),
        )
        if given != planned:
            raise ValueError("attention plan: query or cache differ from the planned layout")
        if out is None:
            out = torch.empty_like(query)
        if out.stride() != self.out_stride or out.shape != query.shape:
            raise ValueError("attention plan: out differs from the planned layout")
        for launch in self.launches:
            launch(query, kv_cache, out)
        return out


class _Launch:
    """One attention launch (and its merge, if KV is split) over query tokens [start, end)."""

    def __init__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        start: int,
        end: int,
        out_stride: tuple[int, ...],
        config: KernelConfig | None = None,
    ) -> None:
        part = query[start:end]
        num_tokens, num_q_heads, head_dim = part.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_q_heads // num_kv_heads
        if config is None:
            config = launch_config(part, kv_cache, meta)
        split_len = config.kv_split_len
        num_splits = config.num_splits(meta.max_seq_len)
        self.start, self.end = start, end
        self.split = num_splits > 1
        part_out: torch.Tensor | None = None
        part_lse: torch.Tensor | None = None
        if self.split:
            part_out = torch.empty(
                (num_splits, num_tokens, num_q_heads, head_dim),
                dtype=torch.float32,
                device=query.device,
            )
            part_lse = torch.empty(
                (num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=query.device
            )
            part_strides = (
                part_out.stride(0),
                part_out.stride(1),
                part_out.stride(2),
                part_lse.stride(0),
                part_lse.stride(1),
            )
        else:
            # unused by the kernel: the output tensor stands in for them at run time
            part_strides = (0, 0, 0, 0, 0)
        self.part_out, self.part_lse = part_out, part_lse
        # one query token per sub-sequence (decodes): one tile each, no tile-to-sequence search
        single = meta.max_query_len == 1
        block_q = 1 if single else config.block_m // group
        tiles = meta.num_seqs if single else num_tokens // block_q + meta.num_seqs
        if tiles > 65535:  # a grid's second axis
            raise ValueError(f"{tiles} query tiles in one attention launch (at most 65535)")
        self.grid = (num_kv_heads, tiles, num_splits)
        # the launch's arguments after q, kv, out, part_out, part_lse
        self.args = (
            meta.cu_query_lens,
            meta.seq_lens,
            meta.block_tables,
            meta.num_seqs,
            split_len or 0,
            scale * _LOG2E,
            query.stride(0),
            query.stride(1),
            out_stride[0],
            out_stride[1],
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            meta.block_tables.stride(0),
            *part_strides,
        )
        self.options = dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            PAGE=meta.block_size,
            BLOCK_M=config.block_m,
            BLOCK_Q=block_q,
            BLOCK_N=config.block_n,
            SPLIT=self.split,
            SINGLE=single,
            PRECISION="ieee" if query.dtype == torch.float32 or not query.is_cuda else "tf32",
            # the CPU interpreter (triton 3.9) multiplies bf16/fp16 tiles wrongly in tl.dot
            DOT_FP32=not query.is_cuda,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        if self.split:
            assert part_out is not None and part_lse is not None
            self.merge_grid = (num_tokens, num_q_heads)
            self.merge_args = (
                num_splits,
                part_out.stride(0),
                part_out.stride(1),
                part_out.stride(2),
                part_lse.stride(0),
                part_lse.stride(1),
                out_stride[0],
                out_stride[1],
            )
            self.merge_options = dict(
                HEAD_DIM=head_dim, SPLITS=triton.next_power_of_2(num_splits), num_warps=4
            )

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        q, o = query[self.start : self.end], out[self.start : self.end]
        part_out = o if self.part_out is None else self.part_out
        part_lse = o if self.part_lse is None else self.part_lse
        _ATTENTION(self.grid, q, kv_cache, o, part_out, part_lse, *self.args, **self.options)
        if self.split:
            _MERGE(self.merge_grid, part_out, part_lse, o, *self.merge_args, **self.merge_options)


_ATTENTION = FastKernel(_paged_attention_kernel)
_WRITE_KV = FastKernel(_write_kv_kernel)
_MERGE = FastKernel(_merge_splits_kernel)
