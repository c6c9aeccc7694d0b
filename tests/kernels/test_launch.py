"""The lean launch path: a step's attention plan replayed for every layer, and Triton launches
that reuse the compiled kernel of an earlier launch with the same argument signature.

The plan runs everywhere (the interpreter on a CPU); the compiled-kernel shortcut only on CUDA,
where Triton compiles kernels (the interpreter has none to reuse)."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from pensieve.kernels.launch import FastKernel
from pensieve.kernels.reference import paged_attention_ref
from pensieve.kernels.triton_attention import AttentionPlan, paged_attention_triton
from tests.kernels.test_triton_attention import (
    DEVICE,
    SubSeq,
    gpu,
    make_case,
    prefix_recompute,
)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(int.from_bytes(os.urandom(4), "little"))  # cases report their seeds


def layers_of(case, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Queries and caches of further layers: the same shapes, other values."""
    gen = torch.Generator(DEVICE).manual_seed(case.seed + 1)
    out = []
    for _ in range(num_layers):
        q = torch.randn(case.query.shape, generator=gen, device=DEVICE).to(case.query.dtype)
        kv = torch.randn(case.kv_cache.shape, generator=gen, device=DEVICE)
        out.append((q, kv.to(case.kv_cache.dtype)))
    return out


def mixed_case(rng, decodes: int, prompt: int, context: int, **shape):
    subseqs = [SubSeq(i, 1, rng.randint(context * 3 // 4, context)) for i in range(decodes)]
    subseqs += [SubSeq(decodes, prompt, prompt + rng.randint(0, context))]
    subseqs += prefix_recompute(rng, decodes + 1, 4 * prompt)
    return make_case(rng, subseqs, **shape)


def check_plan_replays(case, num_layers: int) -> None:
    """A plan made from the first layer gives, for every layer, exactly what a call of
    paged_attention_triton on that layer gives, and that matches the reference."""
    plan = AttentionPlan(case.query, case.kv_cache, case.meta, case.scale)
    for q, kv in layers_of(case, num_layers):
        got = plan.run(q, kv)
        want = paged_attention_triton(q, kv, case.meta, case.scale)
        assert torch.equal(got, want), f"seed={case.seed}"
        ref = paged_attention_ref(q.double(), kv.double(), case.meta, case.scale)
        err = (got.double() - ref).abs().max().item()
        assert err < (1e-3 if q.dtype == torch.float32 else 3e-2), f"seed={case.seed}: {err}"


def test_a_plan_replays_every_layer_of_a_mixed_step(rng):
    # decodes on their own tiles (split KV: long contexts, 4 SMs), then a prompt and a
    # recomputed prefix sharing its table on multi-token tiles
    case = mixed_case(
        rng, 3, 24, 1400, block_size=16, num_kv_heads=2, group=4, head_dim=16, dtype=torch.float32
    )
    plan = AttentionPlan(case.query, case.kv_cache, case.meta, case.scale)
    assert len(plan.launches) == 2 and plan.launches[0].split
    check_plan_replays(case, 3)


def test_a_plan_refuses_a_layer_of_another_shape(rng):
    case = mixed_case(
        rng, 2, 8, 100, block_size=16, num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32
    )
    plan = AttentionPlan(case.query, case.kv_cache, case.meta, case.scale)
    with pytest.raises(ValueError, match="planned layout"):
        plan.run(case.query[1:], case.kv_cache)
    with pytest.raises(ValueError, match="planned layout"):
        plan.run(case.query, case.kv_cache[1:])
    with pytest.raises(ValueError, match="planned layout"):
        plan.run(case.query.to(torch.float64), case.kv_cache)


@pytest.mark.parametrize("decodes", [0, 1, 200])
@gpu
def test_gpu_a_plan_replays_every_layer_of_a_step(rng, decodes):
    case = mixed_case(
        rng,
        decodes,
        300,
        3000,
        block_size=32,
        num_kv_heads=2,
        group=4,
        head_dim=128,
        dtype=torch.bfloat16,
    )
    check_plan_replays(case, 4)


@gpu
def test_gpu_fast_kernel_reuses_the_compiled_kernel(monkeypatch):
    """After one launch through Triton, launches with the same signature skip it and give the
    same result; a tensor at another alignment, or another scalar, goes through Triton again."""
    from pensieve.kernels.fused import _silu_mul_kernel

    kernel = FastKernel(_silu_mul_kernel)
    assert kernel.enabled
    through_triton = []
    real_run = _silu_mul_kernel.run

    def counting_run(*args, **kwargs):
        through_triton.append(kwargs.get("grid"))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(_silu_mul_kernel, "run", counting_run)

    def launch(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.full((rows, n), float("nan"), dtype=gate_up.dtype, device="cuda")
        grid = (rows, -(-n // block))
        kernel(grid, gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4)
        return out

    def want(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)

    for rows in (3, 17, 5):  # the grid may change; the signature does not
        gate_up = torch.randn(rows, 2 * 1000, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(launch(gate_up), want(gate_up), rtol=1e-2, atol=1e-2)
    assert len(through_triton) == 1
    assert kernel._with_constexprs is not None  # the direct launch ran

    flat = torch.randn(4 * 2 * 1000 + 1, device="cuda", dtype=torch.bfloat16)
    misaligned = flat[1:].view(4, 2 * 1000)  # the same strides, 2 bytes past an aligned address
    assert misaligned.data_ptr() % 16
    torch.testing.assert_close(launch(misaligned), want(misaligned), rtol=1e-2, atol=1e-2)
    assert len(through_triton) == 2
    gate_up = torch.randn(4, 2 * 1000, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(launch(gate_up, 512), want(gate_up), rtol=1e-2, atol=1e-2)
    assert len(through_triton) == 3  # another constexpr
    torch.testing.assert_close(launch(gate_up, 512), want(gate_up), rtol=1e-2, atol=1e-2)
    assert len(through_triton) == 3
