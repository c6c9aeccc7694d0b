"""PagedAttention: the per-layer hook, K/V written to the right slots, output = the reference."""

from __future__ import annotations

import pytest
import torch

from pensieve.kernels import AttentionImpl, build_metadata
from pensieve.kernels.reference import paged_attention_ref
from pensieve.models import PRESETS, PagedAttention, allocate_kv_caches


def test_allocate_kv_caches() -> None:
    config = PRESETS["tiny-llama"]
    caches = allocate_kv_caches(config, 5, 4, torch.bfloat16, "cpu")
    assert len(caches) == config.num_layers
    assert all(c.shape == (5, 2, 4, 2, 16) and c.dtype == torch.bfloat16 for c in caches)
    assert all(not bool(c.any()) for c in caches)
    assert caches[0].data_ptr() != caches[1].data_ptr()
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_caches(config, 0, 4, torch.float32, "cpu")


def test_writes_then_attends_after_the_hook() -> None:
    config = PRESETS["tiny-llama"]
    caches = allocate_kv_caches(config, 6, 4, torch.float32, "cpu")
    # two sub-sequences: 3 new tokens after 2 cached ones, and a 1-token decode after 4 cached
    meta = build_metadata([3, 1], [5, 5], [[4, 1], [0, 5]], block_size=4)
    calls: list[int] = []
    attn = PagedAttention(caches, meta, config.attn_scale, AttentionImpl.TORCH, calls.append)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, h, 16, generator=gen) for h in (4, 2, 2))

    out = attn(1, q, k, v)

    assert calls == [1]
    assert out.shape == (4, 4, 16)
    # token 0 of sequence 0 is at position 2: block 4, offset 2; the decode token is position 4
    assert torch.equal(caches[1][4, 0, 2], k[0]) and torch.equal(caches[1][4, 1, 2], v[0])
    assert torch.equal(caches[1][5, 0, 0], k[3])
    assert not bool(caches[0].any())  # other layers untouched
    torch.testing.assert_close(out, paged_attention_ref(q, caches[1], meta, config.attn_scale))
