"""The Llama family in plain PyTorch: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm).

The model sees a flat batch of T tokens from many sequences (no batch dimension); everything that
mixes tokens across positions goes through the attention backend. Q, K and V come out of one fused
projection and gate/up out of another, so a layer runs four matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pensieve.models.attention import AttentionBackend
from pensieve.models.config import Arch, ModelConfig, RopeScaling, RopeType, WeightSlot


class RMSNorm(nn.Module):
    """RMSNorm over the last dim."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel on GPU (the op-by-op form was ~20% of a 13B decode step); in float32
        # it matched Hugging Face's x * rsqrt(mean(x^2) + eps) * weight bit for bit in our tests
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type is RopeType.LINEAR:
        return inv_freq / scaling.factor
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos = [c, c], signed_sin = [-s, s]: [T, D]. Rotates the pairs (i, i + D/2),
    # the Hugging Face layout: x * cos + [-x2, x1] * sin, with the sign moved into the table.
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [x2, x1]
    return x * cos[:, None, :] + swapped * signed_sin[:, None, :]


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

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D], with QK-norm and RoPE applied."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attention = LlamaAttention(config, layer_idx)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        # x: [T, hidden] (the residual stream)
        q, k, v = self.pre_attention(x, cos, sin)
        return self.post_attention(x, attn(self.attention.layer_idx, q, k, v))

    # The layer's two halves around attention: a step's forward may capture them in CUDA graphs
    # and launch only attention eagerly (actors/piecewise.py).

    def pre_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream x [T, hidden] -> this layer's q, k, v (see `LlamaAttention.qkv`)."""
        return self.attention.qkv(self.input_norm(x), cos, sin)

    def post_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] and attention's output [T, Hq, D] -> the residual stream after it."""
        x = x + self.attention.o_proj(attn_out.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_norm(x))


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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        x, cos, sin = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream [T, hidden] and the RoPE tables cos, sin [T, D] all layers share."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        return x, cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] float32
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head.weight).float()

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
