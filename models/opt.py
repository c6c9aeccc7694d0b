"""OPT in plain PyTorch: learned positions (offset 2), LayerNorm, ReLU MLP, biases, fused QKV.

`do_layer_norm_before=True` (every OPT except 350m) is pre-norm with a final LayerNorm;
False is post-norm with no final LayerNorm. Same flat-batch interface as LlamaModel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pensieve.models.attention import AttentionBackend
from pensieve.models.config import OPT_POSITION_OFFSET, Arch, ModelConfig, WeightSlot
from pensieve.models.logits import Logits


class OPTAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=config.qkv_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=config.o_bias)

    def forward(self, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        # x: [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # [T, H D] each
        heads = (num_tokens, self.num_heads, self.head_dim)
        out = attn(
            self.layer_idx,
            q.contiguous().view(heads),
            k.contiguous().view(heads),
            v.contiguous().view(heads),
        )  # [T, H, D]
        return self.out_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class OPTLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.pre_norm = config.do_layer_norm_before
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = OPTAttention(config, layer_idx)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        # x: [T, hidden] (the residual stream)
        if self.pre_norm:
            x = x + self.attention(self.self_attn_layer_norm(x), attn)
            return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.attention(x, attn))
        return self.final_layer_norm(x + self.fc2(F.relu(self.fc1(x))))


class OPTModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.arch is not Arch.OPT:
            raise ValueError(f"OPTModel needs an OPT config, got {config.arch}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + OPT_POSITION_OFFSET, config.hidden_size
        )
        self.layers = nn.ModuleList(OPTLayer(config, i) for i in range(config.num_layers))
        self.final_layer_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
            if config.do_layer_norm_before
            else None
        )
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
        x = self.embed_tokens(input_ids) + self.embed_positions(positions + OPT_POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, attn)
        return x if self.final_layer_norm is None else self.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] float32
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.logits(hidden, head.weight)

    def hf_weight_map(self) -> dict[str, WeightSlot]:
        """Hugging Face checkpoint tensor name -> where it goes in this model."""
        cfg = self.config
        rows = cfg.max_position_embeddings + OPT_POSITION_OFFSET
        slots = {
            "model.decoder.embed_tokens.weight": WeightSlot(
                "embed_tokens.weight", 0, cfg.vocab_size
            ),
            "model.decoder.embed_positions.weight": WeightSlot("embed_positions.weight", 0, rows),
        }
        if self.final_layer_norm is not None:
            for kind in ("weight", "bias"):
                slots[f"model.decoder.final_layer_norm.{kind}"] = WeightSlot(
                    f"final_layer_norm.{kind}", 0, cfg.hidden_size
                )
        if self.lm_head is not None:
            slots["lm_head.weight"] = WeightSlot("lm_head.weight", 0, cfg.vocab_size)
        for i in range(cfg.num_layers):
            slots.update(_layer_slots(cfg, i))
        return slots


def _layer_slots(cfg: ModelConfig, i: int) -> dict[str, WeightSlot]:
    hf, ours = f"model.decoder.layers.{i}.", f"layers.{i}."
    h, inter = cfg.hidden_size, cfg.intermediate_size
    slots: dict[str, WeightSlot] = {}
    for kind in ("weight", "bias"):
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            slots[f"{hf}{norm}.{kind}"] = WeightSlot(f"{ours}{norm}.{kind}", 0, h)
    linear = {
        "self_attn.q_proj": ("attention.qkv_proj", 0, h, cfg.qkv_bias),
        "self_attn.k_proj": ("attention.qkv_proj", h, 2 * h, cfg.qkv_bias),
        "self_attn.v_proj": ("attention.qkv_proj", 2 * h, 3 * h, cfg.qkv_bias),
        "self_attn.out_proj": ("attention.out_proj", 0, h, cfg.o_bias),
        "fc1": ("fc1", 0, inter, cfg.mlp_bias),
        "fc2": ("fc2", 0, h, cfg.mlp_bias),
    }
    for name, (param, start, stop, has_bias) in linear.items():
        for kind in ("weight", "bias") if has_bias else ("weight",):
            slots[f"{hf}{name}.{kind}"] = WeightSlot(f"{ours}{param}.{kind}", start, stop)
    return slots
