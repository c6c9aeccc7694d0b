"""Named model shapes with no checkpoint behind them: loaded as `preset:NAME`, weights random.

The big ones have real shapes for speed measurements; the tiny ones keep CPU tests fast.
"""

from __future__ import annotations

from pensieve.models.config import Arch, ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "llama2-13b-gqa10": ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=32000,
        hidden_size=5120,
        intermediate_size=13824,
        num_layers=40,
        num_heads=40,
        num_kv_heads=10,
        head_dim=128,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="llama2-13b-gqa10",
    ),
    "llama3-8b": ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        name="llama3-8b",
    ),
    "opt-13b": ModelConfig(
        arch=Arch.OPT,
        vocab_size=50272,
        hidden_size=5120,
        intermediate_size=20480,
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        max_position_embeddings=2048,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_ids=(2,),
        name="opt-13b",
    ),
    "tiny-llama": ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-llama",
    ),
    "tiny-qwen3": ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=1000000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        name="tiny-qwen3",
    ),
    "tiny-opt": ModelConfig(
        arch=Arch.OPT,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        max_position_embeddings=1024,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_ids=(2,),
        name="tiny-opt",
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name`; KeyError naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
