"""Torch reference for the paged attention contract (see metadata.py).

Used for CPU execution and as the oracle in tests. Computes in float32 (or float64 when the inputs
are float64) and returns the query dtype.
"""

from __future__ import annotations

import torch

from pensieve.kernels.metadata import AttentionMetadata


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    block_size = kv_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K and V [seq_len, Hkv, D] of one sub-sequence."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[block_table[:num_blocks].long()]  # [nb, 2, bs, Hkv, D]
    k = blocks[:, 0].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = blocks[:, 1].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    num_q_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    start = 0
    for s, (qlen, slen) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        q = query[start : start + qlen].to(compute_dtype)  # [q, Hq, D]
        k, v = gather_kv(kv_cache, meta.block_tables[s], slen)
        k = k.to(compute_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.to(compute_dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q, L]
        q_pos = torch.arange(slen - qlen, slen, device=query.device)[:, None]
        k_pos = torch.arange(slen, device=query.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        start += qlen
    return out
