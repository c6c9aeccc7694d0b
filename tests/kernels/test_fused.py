"""The fused element-wise kernels against their unfused torch references (Triton runs under
TRITON_INTERPRET=1 on a CPU, natively on a GPU)."""

from __future__ import annotations

import pytest
import torch

from pensieve.kernels import AttentionImpl
from pensieve.kernels.fused import add_rms_norm, apply_rope_ref, rope_write_kv, silu_mul
from pensieve.kernels.reference import write_kv_ref

TRITON, TORCH = AttentionImpl.TRITON, AttentionImpl.TORCH
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # one rounding against several: a unit or two in the last place of the low-precision types
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (7, 576), (33, 1000)])
def test_add_rms_norm_matches_add_then_norm(rows, width, dtype):
    gen = torch.Generator().manual_seed(rows * width)
    x, delta = (torch.randn(rows, width, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = torch.rand(width, generator=gen).to(DEVICE, dtype) + 0.5
    total, normed = add_rms_norm(x, delta, weight, 1e-5, TRITON)
    want_total, want_normed = add_rms_norm(x, delta, weight, 1e-5, TORCH)
    torch.testing.assert_close(total, want_total, **tolerance(dtype))
    torch.testing.assert_close(normed, want_normed, **tolerance(dtype))
    assert total.data_ptr() != x.data_ptr()  # the inputs are left as they were


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 1536), (40, 100)])
def test_silu_mul_matches_silu_times_up(rows, inter, dtype):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(DEVICE, dtype)
    torch.testing.assert_close(
        silu_mul(gate_up, TRITON), silu_mul(gate_up, TORCH), **tolerance(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 1, 32)])
def test_rope_write_kv_rotates_q_and_k_and_stores_k_and_v(heads, kv_heads, head_dim, dtype):
    tokens, block_size, num_blocks = 11, 4, 9
    gen = torch.Generator().manual_seed(heads * head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(DEVICE, dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    shape = (num_blocks, 2, block_size, kv_heads, head_dim)
    fused, ref = torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype)
    ref = ref.to(DEVICE)
    q = rope_write_kv(qkv, cos, sin, fused, slots, heads, TRITON)
    want_q = rope_write_kv(qkv, cos, sin, ref, slots, heads, TORCH)
    torch.testing.assert_close(q, want_q, **tolerance(dtype))
    torch.testing.assert_close(fused, ref, **tolerance(dtype))
    # the reference itself: q and k rotated pair-wise (i, i + D/2), v stored as it came
    q_raw, k_raw, v_raw = qkv.float().split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
    )
    half = head_dim // 2
    q_raw = q_raw.view(tokens, heads, head_dim)
    x1, x2 = q_raw[..., :half], q_raw[..., half:]
    c, s = angles.cos().to(DEVICE)[:, None, :], angles.sin().to(DEVICE)[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(want_q.float(), rotated, **tolerance(dtype))
    check = torch.zeros(shape, dtype=dtype, device=DEVICE)
    k = apply_rope_ref(k_raw.view(tokens, kv_heads, head_dim).to(dtype), cos, sin)
    write_kv_ref(k, v_raw.view(tokens, kv_heads, head_dim), check, slots)
    torch.testing.assert_close(ref, check)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots.cpu()] = False
    flat = fused.transpose(1, 2).reshape(num_blocks * block_size, 2, kv_heads, head_dim)
    assert not flat[untouched.to(DEVICE)].any()  # nothing written outside the slots


def test_rope_write_kv_rejects_a_projection_of_the_wrong_width():
    cache = torch.zeros(2, 2, 4, 2, 16)
    with pytest.raises(ValueError, match="qkv of width"):
        rope_write_kv(
            torch.zeros(3, 100),
            torch.zeros(3, 16),
            torch.zeros(3, 16),
            cache,
            torch.arange(3),
            4,
            TRITON,
        )


def gpu(test):
    """Full-size on CUDA: marked gpu, skipped without one."""
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test)
    )


@gpu
def test_gpu_fused_kernels_at_13b_shapes():
    """The 13B preset's shapes in bf16 (hidden 5120, 40 / 10 heads of 128, MLP 13824)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, heads, kv_heads, dim, inter = 300, 5120, 40, 10, 128, 13824

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)

    x, delta, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    for got, want in zip(
        add_rms_norm(x, delta, weight, 1e-5, TRITON),
        add_rms_norm(x, delta, weight, 1e-5, TORCH),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **tolerance(torch.bfloat16))
    gate_up = randn(tokens, 2 * inter)
    torch.testing.assert_close(
        silu_mul(gate_up, TRITON), silu_mul(gate_up, TORCH), **tolerance(torch.bfloat16)
    )
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(tokens, dim // 2, generator=gen, device="cuda") * 100
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(torch.bfloat16)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(torch.bfloat16)
    slots = torch.randperm(64 * 32, generator=gen, device="cuda")[:tokens]
    fused = torch.zeros(64, 2, 32, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    ref = torch.zeros_like(fused)
    q = rope_write_kv(qkv, cos, sin, fused, slots, heads, TRITON)
    torch.testing.assert_close(
        q, rope_write_kv(qkv, cos, sin, ref, slots, heads, TORCH), **tolerance(torch.bfloat16)
    )
    torch.testing.assert_close(fused, ref, **tolerance(torch.bfloat16))


@gpu
def test_gpu_model_logits_fused_against_torch_ops():
    """A whole forward (tiny Llama, bf16) with the fused kernels against the torch operations."""
    from pensieve.actors.config import CacheConfig
    from pensieve.actors.executor.model_runner import ModelRunner
    from pensieve.actors.wire.step import SamplingParams, SeqPiece, StepPlan
    from pensieve.models.loader import load_model

    loaded = load_model("preset:tiny-llama", "cuda", torch.bfloat16, seed=0)
    cache = CacheConfig(block_size=16, num_gpu_blocks=64)
    runner = ModelRunner(
        loaded.model, cache, torch.device("cuda"), torch.bfloat16, cuda_graphs=False
    )
    sampled = SamplingParams()
    plan = StepPlan(
        (
            SeqPiece("a", tuple(range(3, 103)), 0, 100, tuple(range(7)), sampled),
            SeqPiece("b", (9,), 40, 41, tuple(range(7, 10)), sampled),
        )
    )
    logits = {}
    for fused in (False, True):
        loaded.model.set_fused(fused)
        for layer in runner.gpu_caches:
            layer.zero_()
        logits[fused] = runner.logits(plan).float()
    error = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    assert error < 2e-2, f"relative error {error}"


def test_set_fused_picks_the_attention_entry_point():
    """The fused path hands the projection's output to `attend_qkv`; `set_fused(False)` goes back
    to q, k, v through `__call__` (so the GPU comparison above compares two different paths)."""
    from pensieve.models.loader import load_model

    loaded = load_model("preset:tiny-llama", "cpu", torch.float32, seed=0)
    calls: list[str] = []

    class Recorder:
        def __call__(self, layer_idx, q, k, v):
            calls.append("qkv-split")
            return q

        def attend_qkv(self, layer_idx, qkv, cos, signed_sin, num_q_heads):
            calls.append("fused")
            return qkv[:, : num_q_heads * loaded.config.head_dim].reshape(qkv.shape[0], -1)

    ids, positions = torch.arange(5), torch.arange(5)
    for fused, want in ((True, "fused"), (False, "qkv-split")):
        loaded.model.set_fused(fused)
        calls.clear()
        loaded.model(ids, positions, Recorder())
        assert calls == [want] * loaded.config.num_layers
    loaded.model.set_fused(True)
