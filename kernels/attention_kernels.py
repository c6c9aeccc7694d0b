"""The Triton kernels of paged multi-token attention (launched by triton_attention.py).

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

import triton
import triton.language as tl


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
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if MASK:
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    # the running maximum is kept scaled (base 2): one fused multiply-add a score scales it and
    # subtracts the maximum, and the new P @ V accumulates into the rescaled output in the dot
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if not DOT_FP32:
        p = p.to(v.dtype)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
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
        # kv_split_len is cut for the launch's longest context (or, from a CUDA graph, for its
        # context bucket, up to twice the longest): each sub-sequence spreads its own KV over
        # every split instead, in whole tiles and at least 4 tiles a split, so no split of a long
        # sub-sequence sits idle while another covers twice its share
        even = tl.cdiv(tl.cdiv(kv_end, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        seq_split = tl.minimum(kv_split_len, tl.maximum(even, 4 * BLOCK_N))
        kv_lo = split * seq_split
        kv_hi = tl.minimum(kv_lo + seq_split, kv_end)
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
