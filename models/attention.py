"""The attention seam between the models and the paged KV cache.

Models never see the cache: each layer hands its new Q, K, V to an `AttentionBackend`, which owns
where K/V live and which positions a token may see. `PagedAttention` is the production backend:
built once per step around that step's metadata, called once per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from pensieve.kernels import (
    AttentionImpl,
    AttentionMetadata,
    _use_triton,
    paged_attention,
    write_kv,
)
from pensieve.kernels.fused import rope_write_kv
from pensieve.models.config import ModelConfig

if TYPE_CHECKING:
    from pensieve.kernels.triton_attention import AttentionPlan


class AttentionBackend(Protocol):
    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one layer for a flat batch of T tokens.

        q: [T, Hq, D], k and v: [T, Hkv, D], all contiguous, with RoPE and QK-norm already
        applied. Returns [T, Hq, D] in q's dtype. Layers are called in order 0..L-1.
        """
        ...

    def attend_qkv(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        num_q_heads: int,
    ) -> torch.Tensor:
        """The same from the QKV projection's output [T, (Hq + 2 Hkv) D] and the RoPE tables
        [T, D] (see kernels/fused.py), so RoPE and the K/V write can be one kernel."""
        ...


class PagedAttention:
    """Writes each layer's new K/V into its paged cache, then attends over the cache.

    `before_layer(layer_idx)` runs first on every call: the swap manager uses it to wait for that
    layer's swap-in copies, so layer i never waits on copies of later layers.
    """

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        impl: AttentionImpl = AttentionImpl.AUTO,
        before_layer: Callable[[int], None] | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.meta = meta
        self.scale = scale
        self.impl = impl
        self.before_layer = before_layer
        self._plan: AttentionPlan | None = None

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.before_layer is not None:
            self.before_layer(layer_idx)
        cache = self.kv_caches[layer_idx]  # [num_blocks, 2, block_size, Hkv, D]
        write_kv(k, v, cache, self.meta.slot_mapping, self.impl)
        return self._attend(q, cache)

    def attend_qkv(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        num_q_heads: int,
    ) -> torch.Tensor:
        if self.before_layer is not None:
            self.before_layer(layer_idx)
        cache = self.kv_caches[layer_idx]
        q = rope_write_kv(
            qkv, cos, signed_sin, cache, self.meta.slot_mapping, num_q_heads, self.impl
        )
        return self._attend(q, cache)

    def attend(self, layer_idx: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of layer `layer_idx` into `out` [T, Hq, D], its new K/V already in the
        cache (written by a captured graph: actors/executor/piecewise_graphs.py); `before_layer`
        is the caller's to run first."""
        self._attend(q, self.kv_caches[layer_idx], out)

    def _attend(
        self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention over the cache; with Triton through the step's launch plan, made at the first
        layer (every layer's query and cache have the same shapes) and replayed by the others."""
        if not _use_triton(self.impl, q):
            result = paged_attention(q, cache, self.meta, self.scale, self.impl)
            return result if out is None else out.copy_(result)
        if self._plan is None:
            from pensieve.kernels.triton_attention import AttentionPlan

            self._plan = AttentionPlan(q, cache, self.meta, self.scale)
        return self._plan.run(q, cache, out)


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed cache per layer, each [num_blocks, 2, block_size, Hkv, D].

    Zeroed rather than empty so a kernel that reads a whole block and masks the tail never
    multiplies garbage (possibly NaN) by a zero probability.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
        )
    shape = config.kv_cache_shape(num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
