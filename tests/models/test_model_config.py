"""ModelConfig: built from Hugging Face configs, validated, and RoPE frequencies as transformers."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pensieve.models import Arch, ModelConfig, RopeType
from pensieve.models.llama import rope_inv_freq

SMALL = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
)


def test_llama_fields() -> None:
    config = ModelConfig.from_hf(
        LlamaConfig(**SMALL, num_key_value_heads=2, eos_token_id=[5, 6], bos_token_id=1)
    )
    assert config.arch is Arch.LLAMA
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.eos_token_ids == (5, 6) and config.bos_token_id == 1
    assert not (config.qkv_bias or config.o_bias or config.qk_norm or config.tie_word_embeddings)
    assert config.attn_scale == pytest.approx(16**-0.5)
    assert config.kv_cache_shape(7, 32) == (7, 2, 32, 2, 16)


def test_family_options() -> None:
    qwen2 = ModelConfig.from_hf(Qwen2Config(**SMALL, num_key_value_heads=2))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    llama = ModelConfig.from_hf(LlamaConfig(**SMALL, attention_bias=True))
    assert llama.qkv_bias and llama.o_bias


def test_mistral_sliding_window_caps_context() -> None:
    config = ModelConfig.from_hf(
        MistralConfig(
            **SMALL,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=512,
            max_position_embeddings=4096,
        )
    )
    assert config.sliding_window == 512 and config.max_context_len == 512
    wide = dataclasses.replace(config, sliding_window=8192)
    assert wide.max_context_len == 4096


def test_rope_settings_old_and_new_style() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=scaling)
    config = ModelConfig.from_hf(hf)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling.rope_type is RopeType.LLAMA3
    # transformers 4.x style: separate rope_theta, and "type" in older files
    old = SimpleNamespace(**vars(hf), model_type="llama")
    old.rope_parameters = None
    old.rope_theta, old.rope_scaling = 10000.0, {"type": "linear", "factor": 2.0}
    config = ModelConfig.from_hf(old)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type is RopeType.LINEAR


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_inv_freq_matches_transformers(rope_type: str) -> None:
    scaling = {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 4.0},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }[rope_type]
    hf = LlamaConfig(
        **SMALL, max_position_embeddings=256, rope_theta=500000.0, rope_scaling=scaling
    )
    config = ModelConfig.from_hf(hf)
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    if rope_type == "default":
        exponents = torch.arange(0, 16, 2).float() / 16
        expected = 1.0 / (500000.0**exponents)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_opt_fields() -> None:
    config = ModelConfig.from_hf(
        OPTConfig(
            vocab_size=100,
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
        )
    )
    assert config.arch is Arch.OPT and config.num_kv_heads == 4 and config.head_dim == 16
    assert config.qkv_bias and config.o_bias and config.mlp_bias and config.tie_word_embeddings
    assert config.intermediate_size == 96 and config.do_layer_norm_before


def test_opt_projection_is_rejected() -> None:
    hf = OPTConfig(hidden_size=64, num_attention_heads=4, word_embed_proj_dim=32)
    with pytest.raises(ValueError, match="word_embed_proj_dim=32 != hidden_size=64"):
        ModelConfig.from_hf(hf)


def test_unsupported_configs() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf(GPT2Config())
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_hf(LlamaConfig(**SMALL, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf(LlamaConfig(**SMALL, hidden_act="gelu"))


def test_validation() -> None:
    base = ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        max_position_embeddings=16,
    )
    with pytest.raises(ValueError, match="not a multiple"):
        dataclasses.replace(base, num_kv_heads=3)
    with pytest.raises(ValueError, match="even head_dim"):
        dataclasses.replace(base, head_dim=3)
    with pytest.raises(ValueError, match="num_kv_heads must equal num_heads"):
        dataclasses.replace(base, arch=Arch.OPT)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.num_layers = 2  # type: ignore[misc]
