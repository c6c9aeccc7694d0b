"""The torch reference of paged attention against plain dense causal attention (SDPA).

One conversation of N positions is written into a shuffled paged cache; the step computes two
sub-sequences sharing its block table (a recomputed prefix [0, P) and a new prompt [C, N)) beside a
decode of another conversation. Their rows must equal the same rows of dense causal attention over
the whole conversation. Inputs are fresh each run; the seed is in every assertion message.
"""

from __future__ import annotations

import os
import random

import torch
import torch.nn.functional as F

from pensieve.kernels.metadata import build_metadata
from pensieve.kernels.reference import paged_attention_ref, write_kv_ref


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def test_reference_matches_dense_causal_attention():
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block_size, num_kv_heads, group, head_dim = 16, 2, 4, 32
    n, other = rng.randint(20, 300), rng.randint(1, 100)
    c = rng.randint(2, n - 1)
    p = rng.randint(1, c)
    pages, other_pages = -(-n // block_size), -(-other // block_size)
    pool = rng.sample(range(pages + other_pages + 3), pages + other_pages + 3)
    table, other_table = pool[:pages], pool[pages : pages + other_pages]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    k, v = rand(n, num_kv_heads, head_dim), rand(n, num_kv_heads, head_dim)
    q = rand(n, num_kv_heads * group, head_dim)
    cache = rand(len(pool), 2, block_size, num_kv_heads, head_dim)
    write_kv_ref(k, v, cache, build_metadata([n], [n], [table], block_size).slot_mapping)

    meta = build_metadata(
        [p, n - c, 1], [p, n, other], [table, table, other_table], block_size=block_size
    )
    query = torch.cat([q[:p], q[c:], rand(1, num_kv_heads * group, head_dim)])
    scale = head_dim**-0.5
    out = paged_attention_ref(query, cache, meta, scale)
    dense = dense_causal(q, k, v, scale)
    expected = torch.cat([dense[:p], dense[c:]])
    torch.testing.assert_close(out[:-1], expected, msg=lambda m: f"seed={seed}: {m}")
