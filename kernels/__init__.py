"""Attention kernels: the paged multi-token attention kernel in Triton beside its torch reference.

`paged_attention` and `write_kv` pick the implementation: Triton on CUDA tensors (or anywhere when
`impl=AttentionImpl.TRITON`, e.g. under TRITON_INTERPRET=1), the torch reference otherwise.
"""

from __future__ import annotations

import enum

import torch

from pensieve.kernels.metadata import AttentionMetadata, build_metadata
from pensieve.kernels.reference import paged_attention_ref, write_kv_ref


class AttentionImpl(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


def _use_triton(impl: AttentionImpl, tensor: torch.Tensor) -> bool:
    if impl is AttentionImpl.AUTO:
        return tensor.is_cuda
    return impl is AttentionImpl.TRITON


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: AttentionImpl = AttentionImpl.AUTO,
) -> None:
    if _use_triton(impl, kv_cache):
        from pensieve.kernels.triton_attention import write_kv_triton

        write_kv_triton(key, value, kv_cache, slot_mapping)
    else:
        write_kv_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    impl: AttentionImpl = AttentionImpl.AUTO,
) -> torch.Tensor:
    if _use_triton(impl, query):
        from pensieve.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(query, kv_cache, meta, scale)
    return paged_attention_ref(query, kv_cache, meta, scale)


__all__ = [
    "AttentionImpl",
    "AttentionMetadata",
    "build_metadata",
    "paged_attention",
    "write_kv",
]
