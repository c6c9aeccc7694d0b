"""Fused element-wise kernels of the Llama layer, beside their torch references.

Outside its four matrix products and attention, a Llama layer written in torch runs 16 small
kernels: the two RMSNorms and two residual adds, RoPE on q and k (a concatenation, two products and
a sum each), a copy making v contiguous, the K/V write, SiLU and the gate product. At a decode
batch of a few hundred tokens each takes a few microseconds whatever its size, so together they
are about a tenth of a 13B model's decode step. Fused:

    add_rms_norm    x + delta, then RMSNorm of the sum: one pass, both written
    rope_write_kv   RoPE on q and k straight from the QKV projection's output, q written out,
                    k and v written into their cache slots
    silu_mul        SiLU(gate) * up from the gate/up projection's output

Each computes in float32 and rounds once; the torch references (CPU, and the oracle in tests)
are the unfused operations, rounding after each. `impl` picks as in kernels/__init__.py: Triton on
CUDA tensors, or anywhere with AttentionImpl.TRITON (tests, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pensieve.kernels import AttentionImpl, _use_triton
from pensieve.kernels.launch import FastKernel
from pensieve.kernels.reference import write_kv_ref

# ----------------------------------------------------------------------------- add + RMSNorm


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    sum_ptr,
    out_ptr,
    n,
    eps,
    stride_x,
    stride_d,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    # the sum is rounded to the stream's dtype first, as the unfused add stores it
    total = (x + d).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_s + cols, total, mask=mask)
    v = total.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (v * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [T, N]
    delta: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    impl: AttentionImpl = AttentionImpl.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight), both new tensors in x's dtype."""
    if not _use_triton(impl, x):
        total = x + delta
        return total, F.rms_norm(total, (total.shape[-1],), weight, eps)
    if x.shape != delta.shape or x.stride(-1) != 1 or delta.stride(-1) != 1:
        raise ValueError(f"add_rms_norm: shapes {tuple(x.shape)} and {tuple(delta.shape)}")
    rows, n = x.shape
    total, out = torch.empty_like(x), torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        _ADD_RMS_NORM(
            (rows,),
            x,
            delta,
            weight,
            total,
            out,
            n,
            eps,
            x.stride(0),
            delta.stride(0),
            total.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=max(1, min(16, block // 512)),
        )
    return total, out


# ------------------------------------------------------------------------ RoPE + K/V write


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos = [c, c], signed_sin = [-s, s]: [T, D]. Rotates the pairs (i, i + D/2),
    the Hugging Face layout: x * cos + [-x2, x1] * sin, with the sign moved into the table."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [x2, x1]
    return x * cos[:, None, :] + swapped * signed_sin[:, None, :]


@triton.jit
def _rope_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    cache_ptr,
    slot_ptr,
    stride_t,
    stride_cs,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ckv,
    stride_cp,
    stride_ch,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
):
    # one program per (token, head): heads 0..HQ-1 are q heads, HQ..HQ+HKV-1 the k/v heads
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    partner = (d + D // 2) % D  # [x2, x1]: the rotated pair's other half
    cos = tl.load(cos_ptr + t * stride_cs + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cs + d).to(tl.float32)
    src = qkv_ptr + t * stride_t + head * D
    x = tl.load(src + d).to(tl.float32)
    rotated = x * cos + tl.load(src + partner).to(tl.float32) * sin
    if head < HQ:
        tl.store(q_ptr + t * stride_qt + head * stride_qh + d, rotated.to(q_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + t)
        dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cp
        dst += (head - HQ) * stride_ch
        tl.store(dst + d, rotated.to(cache_ptr.dtype.element_ty))
        v = tl.load(src + HKV * D + d)
        tl.store(dst + stride_ckv + d, v.to(cache_ptr.dtype.element_ty))


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]: the QKV projection's output
    cos: torch.Tensor,  # [T, D]
    signed_sin: torch.Tensor,  # [T, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    num_q_heads: int,
    impl: AttentionImpl = AttentionImpl.AUTO,
) -> torch.Tensor:
    """RoPE on q and k; k and v stored at each token's slot; returns q [T, Hq, D]."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if qkv.shape[1] != q_size + 2 * kv_size:
        raise ValueError(f"qkv of width {qkv.shape[1]}, expected {q_size + 2 * kv_size}")
    if not _use_triton(impl, qkv):
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope_ref(q.view(num_tokens, num_q_heads, head_dim), cos, signed_sin)
        k = apply_rope_ref(k.view(num_tokens, num_kv_heads, head_dim), cos, signed_sin)
        write_kv_ref(k, v.reshape(num_tokens, num_kv_heads, head_dim), kv_cache, slot_mapping)
        return q
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("rope_write_kv: the last dimensions must be contiguous")
    if cos.stride(0) != signed_sin.stride(0) or kv_cache.stride(-1) != 1:
        raise ValueError("rope_write_kv: cos and sin must share a layout, the cache be contiguous")
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _ROPE_WRITE(
            (num_tokens, num_q_heads + num_kv_heads),
            qkv,
            cos,
            signed_sin,
            q,
            kv_cache,
            slot_mapping,
            qkv.stride(0),
            cos.stride(0),
            q.stride(0),
            q.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            HQ=num_q_heads,
            HKV=num_kv_heads,
            D=head_dim,
            PAGE=kv_cache.shape[2],
            num_warps=1,
        )
    return q


# ---------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, impl: AttentionImpl = AttentionImpl.AUTO) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> SiLU(gate) * up [T, I]."""
    if not _use_triton(impl, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_mul: the last dimension must be contiguous")
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        grid = (rows, triton.cdiv(n, block))
        _SILU_MUL(grid, gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


_ADD_RMS_NORM = FastKernel(_add_rms_norm_kernel)
_ROPE_WRITE = FastKernel(_rope_write_kernel)
_SILU_MUL = FastKernel(_silu_mul_kernel)
