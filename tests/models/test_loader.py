"""load_model: spec resolution, weight-map coverage, and clear one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

from pensieve.models import PRESETS, ModelLoadError, build_model, load_model
from pensieve.models.config import Arch

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _load_error(spec: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(spec, "cpu", torch.float32)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(tmp_path)
    return tmp_path


def _edit_weights(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_hf_folder_loads_into_target_dtype(tiny_folder: Path) -> None:
    loaded = load_model(str(tiny_folder), "cpu", torch.bfloat16)
    assert loaded.config.num_layers == 2 and loaded.config.arch is Arch.LLAMA
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    reference = load_file(tiny_folder / "model.safetensors")
    fused = loaded.model.layers[1].attention.qkv_proj.weight
    assert torch.equal(fused[32:48], reference["model.layers.1.self_attn.k_proj.weight"].bfloat16())


def test_unknown_spec() -> None:
    message = _load_error("not-a-model")
    assert "model not found: 'not-a-model'" in message and "preset:NAME" in message


def test_missing_path() -> None:
    assert "model not found: '/no/such/dir/model.gguf'" in _load_error("/no/such/dir/model.gguf")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    assert "must end in .gguf" in _load_error(str(path))


def test_folder_without_config(tmp_path: Path) -> None:
    assert "no config.json" in _load_error(str(tmp_path))


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    message = _load_error(str(tmp_path))
    assert "unsupported model_type 'gpt2'" in message and "qwen3" in message


def test_opt_with_projection_is_refused(tmp_path: Path) -> None:
    OPTConfig(hidden_size=32, num_attention_heads=4, word_embed_proj_dim=16).save_pretrained(
        tmp_path
    )
    assert "word_embed_proj_dim=16 != hidden_size=32" in _load_error(str(tmp_path))


def test_folder_without_weights(tmp_path: Path) -> None:
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert "no *.safetensors" in _load_error(str(tmp_path))


def test_missing_tensor(tiny_folder: Path) -> None:
    _edit_weights(tiny_folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    message = _load_error(str(tiny_folder))
    assert "missing 1 [model.layers.1.mlp.up_proj.weight]" in message
    assert "unexpected none" in message


def test_unexpected_tensor(tiny_folder: Path) -> None:
    _edit_weights(tiny_folder, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    assert "unexpected 1 [model.extra.weight]" in _load_error(str(tiny_folder))


def test_wrong_shape(tiny_folder: Path) -> None:
    _edit_weights(tiny_folder, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    assert "model.norm.weight has shape (31,), expected (32,)" in _load_error(str(tiny_folder))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_weight_map_covers_every_parameter_once(name: str) -> None:
    model = build_model(PRESETS[name], "meta", torch.float32)
    params = dict(model.named_parameters())
    covered = {n: torch.zeros(p.shape[0], dtype=torch.int32) for n, p in params.items()}
    for slot in model.hf_weight_map().values():
        covered[slot.param][slot.start : slot.stop] += 1
    assert all(bool((rows == 1).all()) for rows in covered.values())
