"""Model families, their config, weight loading and the attention seam to the paged KV cache.

The engine's entry points:

    loaded = load_model(spec, device, dtype)          # LoadedModel(model, config, tokenizer)
    kv_caches = allocate_kv_caches(config, num_blocks, block_size, dtype, device)
    attn = PagedAttention(kv_caches, meta, config.attn_scale, impl, before_layer)   # per step
    hidden = loaded.model(input_ids, positions, attn)  # [T] -> [T, hidden]
    logits = loaded.model.compute_logits(hidden[last_token_indices])  # float32 [N, vocab]
"""

from pensieve.models.attention import AttentionBackend, PagedAttention, allocate_kv_caches
from pensieve.models.config import Arch, ModelConfig, RopeScaling, RopeType
from pensieve.models.llama import LlamaModel
from pensieve.models.loader import (
    CausalLM,
    LoadedModel,
    ModelLoadError,
    build_model,
    init_random_,
    load_model,
)
from pensieve.models.opt import OPTModel
from pensieve.models.presets import PRESETS, get_preset

__all__ = [
    "PRESETS",
    "Arch",
    "AttentionBackend",
    "CausalLM",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "OPTModel",
    "PagedAttention",
    "RopeScaling",
    "RopeType",
    "allocate_kv_caches",
    "build_model",
    "get_preset",
    "init_random_",
    "load_model",
]
