"""The Llama family in plain PyTorch: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm).

The model sees a flat batch of T tokens from many sequences (no batch dimension); everything that
mixes tokens across positions goes through the attention backend. Q, K and V come out of one fused
projection and gate/up out of another, so a layer runs four matmuls. On GPU the element-wise work
between them is fused (kernels/fused.py): each residual add with the norm after it, RoPE with the
K/V write, SiLU with the gate product; a layer then launches four small kernels besides the
matmuls and attention instead of sixteen.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pensieve.kernels import AttentionImpl
from pensieve.kernels.fused import add_rms_norm, apply_rope_ref, silu_mul
from pensieve.models.attention import AttentionBackend
from pensieve.models.config import Arch, ModelConfig, RopeScaling, RopeType, WeightSlot
from pensieve.models.logits import Logits


class RMSNorm(nn.Module):
    """RMSNorm over the last dim."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.fused = True  # see LlamaModel.set_fused

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it) in one kernel on GPU; (x, norm of x) without a delta."""
        if delta is None:
            return x, self(x)
        impl = AttentionImpl.AUTO if self.fused else AttentionImpl.TORCH
        return add_rms_norm(x, delta, self.weight, self.eps, impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one kernel on GPU rather than several small ones op by op; in float32 it matches Hugging
        # Face's x * rsqrt(mean(x^2) + eps) * weight bit for bit
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type is RopeType.LINEAR:
        return inv_freq / scaling.factor
    if scaling.rope_type is RopeType.FREQ_FACTORS:
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32, device="cpu")
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self._inv_freq_cpu = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, signed_sin: [T, D] in `dtype`, shared by every layer
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(positions.device)
            self._inv_freq[positions.device] = inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.fused = True

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        # x: [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        if self.q_norm is None and self.fused:  # RoPE, K/V write, attention from the output
            out = attn.attend_qkv(self.layer_idx, qkv, cos, sin, self.num_heads)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        impl = AttentionImpl.AUTO if self.fused else AttentionImpl.TORCH
        # x: [T, hidden] -> gate and up [T, 2I] -> [T, I] -> [T, hidden]
        return self.down_proj(silu_mul(self.gate_up_proj(x), impl))


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attention = LlamaAttention(config, layer_idx)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, hidden]; pending: the previous layer's MLP output, not yet
        added to it (None before the first layer). Returns (x, this layer's MLP output): each
        residual add is fused with the norm that follows it."""
        x, h = self.input_norm.add_norm(x, pending)
        x, h = self.post_attention_norm.add_norm(x, self.attention(h, cos, sin, attn))
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.arch is not Arch.LLAMA:
            raise ValueError(f"LlamaModel needs a Llama-family config, got {config.arch}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.logits = Logits()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # [T, D] each, shared by all layers
        pending = None
        for layer in self.layers:
            x, pending = layer(x, pending, cos, sin, attn)
        return self.norm.add_norm(x, pending)[1]

    def set_fused(self, fused: bool) -> None:
        """Fused element-wise kernels on GPU (kernels/fused.py; the default), or the unfused torch
        operations they replace (for benchmarks side by side). CPUs run the latter either way."""
        for module in self.modules():
            if isinstance(module, RMSNorm | LlamaAttention | LlamaMLP):
                module.fused = fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] float32
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.logits(hidden, head.weight)

    def hf_weight_map(self) -> dict[str, WeightSlot]:
        """Hugging Face checkpoint tensor name -> where it goes in this model."""
        cfg = self.config
        slots = {
            "model.embed_tokens.weight": _whole("embed_tokens.weight", cfg.vocab_size),
            "model.norm.weight": _whole("norm.weight", cfg.hidden_size),
        }
        if self.lm_head is not None:
            slots["lm_head.weight"] = _whole("lm_head.weight", cfg.vocab_size)
        for i in range(cfg.num_layers):
            slots.update(_layer_slots(cfg, i))
        return slots


def _whole(param: str, rows: int) -> WeightSlot:
    return WeightSlot(param, 0, rows)


def _layer_slots(cfg: ModelConfig, i: int) -> dict[str, WeightSlot]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    q, kv, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    slots: dict[str, WeightSlot] = {}
    kinds = ["weight", "bias"] if cfg.qkv_bias else ["weight"]
    for proj, (start, stop) in qkv_rows.items():
        for kind in kinds:
            slots[f"{hf}self_attn.{proj}.{kind}"] = WeightSlot(
                f"{ours}attention.qkv_proj.{kind}", start, stop
            )
    for kind in ["weight", "bias"] if cfg.o_bias else ["weight"]:
        slots[f"{hf}self_attn.o_proj.{kind}"] = _whole(
            f"{ours}attention.o_proj.{kind}", cfg.hidden_size
        )
    for kind in ["weight", "bias"] if cfg.mlp_bias else ["weight"]:
        slots[f"{hf}mlp.gate_proj.{kind}"] = WeightSlot(f"{ours}mlp.gate_up_proj.{kind}", 0, inter)
        slots[f"{hf}mlp.up_proj.{kind}"] = WeightSlot(
            f"{ours}mlp.gate_up_proj.{kind}", inter, 2 * inter
        )
        slots[f"{hf}mlp.down_proj.{kind}"] = _whole(f"{ours}mlp.down_proj.{kind}", cfg.hidden_size)
    if cfg.qk_norm:
        slots[f"{hf}self_attn.q_norm.weight"] = _whole(
            f"{ours}attention.q_norm.weight", cfg.head_dim
        )
        slots[f"{hf}self_attn.k_norm.weight"] = _whole(
            f"{ours}attention.k_norm.weight", cfg.head_dim
        )
    slots[f"{hf}input_layernorm.weight"] = _whole(f"{ours}input_norm.weight", cfg.hidden_size)
    slots[f"{hf}post_attention_layernorm.weight"] = _whole(
        f"{ours}post_attention_norm.weight", cfg.hidden_size
    )
    return slots
