"""Paged multi-token attention in Triton: one kernel for decode, prefill and everything between.

The contract is metadata.py's; reference.py computes the same function in torch.

One program owns one *tile*: up to BLOCK_Q consecutive query tokens of one sub-sequence times the
GROUP query heads that share one KV head, flattened into BLOCK_M = BLOCK_Q * GROUP rows, so every
K/V tile is read once per KV head and feeds GROUP heads at once:

    row r  ->  query token  tile_start + r // GROUP,  query head  kv_head * GROUP + r % GROUP

    grid = (KV heads, query tiles, KV splits)

Query tiles are numbered without a per-step table: sub-sequence s owns the tile ids starting at
cu_query_lens[s] // BLOCK_Q + s (an upper bound on the tiles before it), so num_tokens // BLOCK_Q +
num_seqs ids cover every tile and a program finds its sub-sequence by binary search over
cu_query_lens; ids that fall past the end of a sub-sequence's tiles exit at once. A launch of
decodes only (one query token per sub-sequence) skips both: tile s is sub-sequence s (SINGLE).

A KV tile of BLOCK_N positions may span several pages: each position looks up its own page in the
block table. Only the last KV tiles of a query tile cross the causal diagonal, so the loop runs in
two parts, the first without masks. With split-KV (long contexts, few query tiles) each program
covers kv_split_len positions and writes a normalised partial output plus its log-sum-exp; a second
small kernel merges the splits.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pensieve.kernels.launch import FastKernel
from pensieve.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SMEM_LIMIT = 228 * 1024  # shared memory per SM on Hopper
_DECODE_ROWS = 64  # query rows (tokens x group) up to which a launch takes decode tiles


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the attention kernel. kv_split_len=None: one program covers all of KV."""

    block_m: int  # rows per tile: query tokens x group heads (a power of two, >= 16)
    block_n: int  # KV positions per inner step (a power of two, >= 16)
    num_warps: int
    num_stages: int
    kv_split_len: int | None = None  # KV positions per split, a multiple of block_n


# ----------------------------------------------------------------------------------- kernels


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    start_n,
    kv_end,
    bt_row,
    k_base,
    v_base,
    stride_cp,
    stride_cb,
    qk_scale,
    offs_n,
    offs_d,
    PAGE: tl.constexpr,
    MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # one online-softmax step over KV positions [start_n, start_n + BLOCK_N)
    pos = start_n + offs_n  # [BLOCK_N]
    if MASK:
        in_seq = pos < kv_end
        page = tl.load(bt_row + pos // PAGE, mask=in_seq, other=0)
    else:
        page = tl.load(bt_row + pos // PAGE)
    kv_off = page.to(tl.int64) * stride_cb + (pos % PAGE).to(tl.int64) * stride_cp
    kv_ptrs = kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, D]
    if MASK:
        k = tl.load(k_base + kv_ptrs, mask=in_seq[:, None], other=0.0)
        v = tl.load(v_base + kv_ptrs, mask=in_seq[:, None], other=0.0)
    else:
        k = tl.load(k_base + kv_ptrs)
        v = tl.load(v_base + kv_ptrs)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2
    if MASK:
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if not DOT_FP32:
        p = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, l_i, m_new


# Triton specializes integer arguments on "== 1" and "divisible by 16" and compiles a variant for
# each combination it meets. Arguments that change from step to step (the batch, the table width,
# the split buffers' outer strides) are left unspecialized: otherwise a long-running server keeps
# meeting new combinations, and each one compiled inside a step stalls every running request for
# ~1 s. Pointers are specialized on 16-byte alignment, except three: the step metadata's cu_q,
# seq_lens and block tables are views into one uploaded int32 buffer, at offsets that follow the
# number of sub-sequences, so their alignment changes from step to step too, while start-up
# compiles only the aligned variants.
@triton.jit(
    do_not_specialize=["num_seqs", "kv_split_len", "stride_bt", "stride_ps", "stride_ls"],
    do_not_specialize_on_alignment=["cu_q_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    kv_split_len,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_cp,
    stride_ch,
    stride_bt,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SINGLE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # the grid's fastest axis is the KV head, so the GPU starts every head of a tile together,
    # and the highest tile ids first: the last tiles of a sub-sequence attend to the most keys
    # (and the executor puts the longest decodes last), so the launch ends on short tiles
    kv_head = tl.program_id(0)
    tile_id = tl.num_programs(1) - 1 - tl.program_id(1)
    split = tl.program_id(2)

    if SINGLE:
        # one query token per sub-sequence (decodes): tile s is sub-sequence s, token s
        seq = tile_id
        q_start = tile_id
        q_len = tile_id * 0 + 1
        tile_q = tile_id * 0
    else:
        # sub-sequence of this tile: the largest s with cu_q[s] // BLOCK_Q + s <= tile_id
        lo = tile_id * 0
        hi = lo + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            go_right = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= tile_id
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        seq = lo
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        tile_q = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of the tile
        if tile_q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # positions cached before the first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = tile_q + offs_m // GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx  # [BLOCK_M] causal limit of each row
    token = (q_start + q_idx).to(tl.int64)
    head = kv_head * GROUP + offs_m % GROUP
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    if DOT_FP32:
        q = q.to(tl.float32)

    kv_end = context + tl.minimum(q_len, tile_q + BLOCK_Q)  # one past the last position seen
    full_end = (context + tile_q + 1) // BLOCK_N * BLOCK_N  # below this every row sees all keys
    if SPLIT:
        kv_lo = split * kv_split_len
        kv_hi = tl.minimum(kv_lo + kv_split_len, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = kv_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(kv_lo, tl.minimum(kv_hi, full_end), BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            start_n,
            kv_end,
            bt_row,
            k_base,
            v_base,
            stride_cp,
            stride_cb,
            qk_scale,
            offs_n,
            offs_d,
            PAGE,
            False,
            PRECISION,
            DOT_FP32,
        )
    for start_n in range(tl.maximum(kv_lo, full_end), kv_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            start_n,
            kv_end,
            bt_row,
            k_base,
            v_base,
            stride_cp,
            stride_cb,
            qk_scale,
            offs_n,
            offs_d,
            PAGE,
            True,
            PRECISION,
            DOT_FP32,
        )

    if SPLIT:
        # a split past a row's causal limit leaves l_i = 0: lse = -inf and a zero partial output
        seen = l_i > 0
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        row = split * stride_ps + token * stride_pt + head * stride_ph
        tl.store(part_out_ptr + row[:, None] + offs_d[None, :], o, mask=row_ok[:, None])
        lse_ptrs = part_lse_ptr + split * stride_ls + token * stride_lt + head
        tl.store(lse_ptrs, lse, mask=row_ok)
    else:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ls"])
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    used = offs_s < num_splits
    lse = tl.load(
        part_lse_ptr + offs_s * stride_ls + token * stride_lt + head, mask=used, other=float("-inf")
    )
    weight = tl.exp2(lse - tl.max(lse, 0))  # [SPLITS]; at least one split saw keys
    part_ptrs = part_out_ptr + token * stride_pt + head * stride_ph
    part = tl.load(
        part_ptrs + offs_s[:, None] * stride_ps + offs_d[None, :], mask=used[:, None], other=0.0
    )
    o = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cp,
    stride_ch,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    offs_h = tl.arange(0, HEADS)
    offs_d = tl.arange(0, HEAD_DIM)
    used = (offs_h < num_kv_heads)[:, None]
    dst = kv_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cp
    dst_ptrs = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], used)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], used)
    tl.store(dst_ptrs, k.to(kv_ptr.dtype.element_ty), mask=used)
    tl.store(dst_ptrs + stride_ckv, v.to(kv_ptr.dtype.element_ty), mask=used)


# ----------------------------------------------------------------------------------- launch


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
    num_splits = min(num_splits, max_seq_len // 512)  # a split below 512 positions costs more
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

    With decode tiles (~3 resident programs per SM), a grid that fits in one wave of resident
    programs runs best unsplit; a grid of 1-2 waves loses up to 20% to its tail, so it is split
    until it spans at least 3 waves.
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
    most_splits = max(2, max_context // 512)
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
        num_splits = 1 if split_len is None else triton.cdiv(meta.max_seq_len, split_len)
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
