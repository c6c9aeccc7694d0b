"""Presets: tiny ones run; big ones have the right shapes (built on the meta device, no memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_generate import greedy_generate, prompt_logits

from pensieve.models import PRESETS, Arch, ModelLoadError, RopeScaling, RopeType, load_model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-opt"])
def test_tiny_preset_runs(name: str) -> None:
    loaded = load_model(f"preset:{name}", "cpu", torch.float32)
    assert loaded.tokenizer is None and loaded.config is PRESETS[name]
    prompt = list(range(3, 20))
    logits = prompt_logits(loaded.model, prompt)
    assert logits.shape == (len(prompt), loaded.config.vocab_size)
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())
    (tokens,) = greedy_generate(loaded.model, [prompt], 8)
    assert len(tokens) == 8


def test_preset_seed_decides_weights() -> None:
    def weights(seed: int) -> torch.Tensor:
        model = load_model("preset:tiny-llama", "cpu", torch.float32, seed=seed).model
        return model.layers[0].attention.qkv_proj.weight.clone()

    assert torch.equal(weights(1), weights(1))
    assert not torch.equal(weights(1), weights(2))


def test_random_init_is_in_target_dtype() -> None:
    model = load_model("preset:tiny-llama", "cpu", torch.bfloat16).model
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert float(params["layers.0.attention.qkv_proj.weight"].float().std()) == pytest.approx(
        0.02, rel=0.1
    )
    assert bool((params["norm.weight"] == 1).all())


def _num_params(name: str) -> tuple[dict[str, tuple[int, ...]], int]:
    model = load_model(f"preset:{name}", "meta", torch.bfloat16).model
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    return shapes, sum(p.numel() for p in model.parameters())


def test_llama2_13b_gqa10_shapes() -> None:
    shapes, total = _num_params("llama2-13b-gqa10")
    assert shapes["layers.39.attention.qkv_proj.weight"] == ((40 + 2 * 10) * 128, 5120)
    assert shapes["layers.0.attention.o_proj.weight"] == (5120, 5120)
    assert shapes["layers.0.mlp.gate_up_proj.weight"] == (2 * 13824, 5120)
    assert shapes["lm_head.weight"] == shapes["embed_tokens.weight"] == (32000, 5120)
    assert "layers.40.input_norm.weight" not in shapes
    per_layer = 5120 * (60 * 128) + 5120 * 5120 + 3 * 5120 * 13824 + 2 * 5120
    assert total == 40 * per_layer + 2 * 32000 * 5120 + 5120
    config = PRESETS["llama2-13b-gqa10"]
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 40 * 10 * 128 * 2


def test_llama3_8b_has_8_03b_params() -> None:
    shapes, total = _num_params("llama3-8b")
    assert total == 8_030_261_248  # Meta-Llama-3-8B
    assert shapes["layers.0.attention.qkv_proj.weight"] == ((32 + 2 * 8) * 128, 4096)
    assert PRESETS["llama3-8b"].rope_theta == 500000.0


def test_llama3_1_8b_is_llama3_8b_with_128k_scaled_rope() -> None:
    shapes, total = _num_params("llama3.1-8b")
    assert total == 8_030_261_248  # Llama-3.1-8B: the same weights' shapes as Llama 3
    assert shapes["layers.31.attention.qkv_proj.weight"] == ((32 + 2 * 8) * 128, 4096)
    assert shapes["layers.0.mlp.gate_up_proj.weight"] == (2 * 14336, 4096)
    config = PRESETS["llama3.1-8b"]
    assert config.max_context_len == 131072 and config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(RopeType.LLAMA3, 8.0, 1.0, 4.0, 8192)
    assert config.kv_bytes_per_token(torch.bfloat16) == 128 * 1024  # 2 x 32 x 8 x 128 x 2 B


@pytest.mark.parametrize(
    ("name", "num_layers", "hidden", "num_heads", "ffn", "num_params", "kv_kib"),
    [
        ("qwen3-8b", 36, 4096, 32, 12288, 8_190_735_360, 144),  # Qwen/Qwen3-8B
        ("qwen3-32b", 64, 5120, 64, 25600, 32_762_123_264, 256),  # Qwen/Qwen3-32B
    ],
)
def test_qwen3_shapes(
    name: str, num_layers: int, hidden: int, num_heads: int, ffn: int, num_params: int, kv_kib: int
) -> None:
    shapes, total = _num_params(name)
    assert total == num_params
    last = num_layers - 1
    assert shapes[f"layers.{last}.attention.qkv_proj.weight"] == ((num_heads + 16) * 128, hidden)
    assert shapes[f"layers.{last}.attention.q_norm.weight"] == (128,)  # QK-norm over head_dim
    assert shapes["layers.0.mlp.gate_up_proj.weight"] == (2 * ffn, hidden)
    assert shapes["lm_head.weight"] == shapes["embed_tokens.weight"] == (151936, hidden)
    config = PRESETS[name]
    assert config.max_context_len == 32768 and config.rope_scaling is None
    assert config.rope_theta == 1_000_000.0 and config.qk_norm
    assert config.kv_bytes_per_token(torch.bfloat16) == kv_kib * 1024  # 2 x L x 8 x 128 x 2 B


def test_opt_13b_shapes() -> None:
    shapes, total = _num_params("opt-13b")
    config = PRESETS["opt-13b"]
    assert config.arch is Arch.OPT and config.tie_word_embeddings
    assert shapes["embed_positions.weight"] == (2048 + 2, 5120)
    assert shapes["layers.0.fc1.weight"] == (20480, 5120)
    assert "lm_head.weight" not in shapes
    assert total == 12_853_473_280  # facebook/opt-13b


def test_unknown_preset() -> None:
    with pytest.raises(ModelLoadError, match="unknown preset 'nope'.*tiny-llama"):
        load_model("preset:nope", "cpu", torch.float32)


def test_llama2_70b_shapes() -> None:
    shapes, total = _num_params("llama2-70b")
    assert shapes["layers.79.attention.qkv_proj.weight"] == ((64 + 2 * 8) * 128, 8192)
    assert shapes["layers.0.mlp.gate_up_proj.weight"] == (2 * 28672, 8192)
    assert shapes["lm_head.weight"] == shapes["embed_tokens.weight"] == (32000, 8192)
    assert total == 68_976_648_192  # Llama-2-70b-hf
    config = PRESETS["llama2-70b"]
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 80 * 8 * 128 * 2


def test_opt_66b_shapes() -> None:
    shapes, total = _num_params("opt-66b")
    config = PRESETS["opt-66b"]
    assert config.arch is Arch.OPT and config.tie_word_embeddings
    assert shapes["layers.63.attention.qkv_proj.weight"] == (3 * 9216, 9216)
    assert shapes["layers.0.fc1.weight"] == (36864, 9216)
    assert "lm_head.weight" not in shapes
    h, f = 9216, 36864
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    assert total == 64 * per_layer + 50272 * h + (2048 + 2) * h + 2 * h


@pytest.mark.parametrize(("name", "ranks"), [("llama2-70b", 8), ("opt-66b", 8), ("opt-66b", 4)])
def test_paper_models_split_over_their_gpus(name: str, ranks: int) -> None:
    config = dataclasses.replace(PRESETS[name], tensor_parallel_size=ranks)
    assert config.num_kv_heads_per_rank * ranks == config.num_kv_heads


def test_kv_heads_that_do_not_divide_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="llama2-70b: its 8 KV heads do not divide over 3"):
        dataclasses.replace(PRESETS["llama2-70b"], tensor_parallel_size=3)
