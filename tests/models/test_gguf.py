"""Our one-parse GGUF reading (models/gguf.py, gguf_llama.py) against gguf-py and transformers.

Tiny files written with `gguf.GGUFWriter` check the reader on every value type and on float and
block-quantized tensors, and check the llama conversion (config, weights, tokenizer with either
pre-tokenizer split) against transformers' own GGUF loading of the same file. The slow tests do
the same on the real SmolLM2 file, with real ShareGPT text for the tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pensieve.models import ModelConfig, ModelLoadError, RopeScaling, RopeType, load_model
from pensieve.models.assets import smollm2_gguf_path
from pensieve.models.gguf import GGUFError, GGUFFile, read_gguf
from pensieve.models.gguf_llama import (
    byte_level_tokenizer,
    hf_config,
    hf_name,
    llama_tensors,
    load_tokenizer,
    supports,
)
from pensieve.models.llama import rope_inv_freq
from pensieve.ops.sharegpt import load_conversations

# ---- the reader ------------------------------------------------------------------------------

METADATA: list[tuple[str, Any, V, V | None]] = [
    ("t.u8", 250, V.UINT8, None),
    ("t.i8", -100, V.INT8, None),
    ("t.u16", 65000, V.UINT16, None),
    ("t.i16", -32000, V.INT16, None),
    ("t.u32", 4_000_000_000, V.UINT32, None),
    ("t.i32", -2_000_000_000, V.INT32, None),
    ("t.f32", -2.25, V.FLOAT32, None),
    ("t.bool", True, V.BOOL, None),
    ("t.str", "héllo, 世界 🙂", V.STRING, None),
    ("t.u64", 2**63 + 5, V.UINT64, None),
    ("t.i64", -(2**62), V.INT64, None),
    ("t.f64", 1 / 3, V.FLOAT64, None),
    ("t.strs", ["a", "", "ü", "Ġthe", "<|im_end|>", "日本語"], V.ARRAY, V.STRING),
    ("t.i32s", [1, -2, 3], V.ARRAY, V.INT32),
    ("t.u64s", [0, 2**40], V.ARRAY, V.UINT64),
    ("t.f32s", [0.5, -1.75], V.ARRAY, V.FLOAT32),
    ("t.bools", [True, False], V.ARRAY, V.BOOL),
    ("t.nested", [[1, 2], [3]], V.ARRAY, None),
]


def _write(
    path: Path,
    metadata: list[tuple[str, Any, V, V | None]],
    tensors: dict[str, Any],
    alignment: int | None = None,
) -> None:
    """Write a GGUF file; `tensors` maps a name to an array or to (raw bytes, quantization type)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, vtype, sub_type in metadata:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _sample_tensors() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    q4 = rng.standard_normal((2, 3, 64)).astype(np.float32)
    return {
        "f32": rng.standard_normal((3, 64)).astype(np.float32),
        "norm": rng.standard_normal(96).astype(np.float32),
        "f16": rng.standard_normal((5, 32)).astype(np.float16),
        "q8": (gguf.quantize(q8, Q.Q8_0), Q.Q8_0),
        "q4": (gguf.quantize(q4, Q.Q4_0), Q.Q4_0),
    }


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_round_trip(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "t.gguf"
    tensors = _sample_tensors()
    _write(path, METADATA, tensors, alignment)

    read = read_gguf(path)
    expected = {key: value for key, value, _, _ in METADATA}
    if alignment is not None:
        expected["general.alignment"] = alignment
    assert read.metadata == {"general.architecture": "llama", **expected}
    assert read.version == 3 and read.alignment == (alignment or 32)
    assert list(read.tensors) == list(tensors)

    reference = gguf.GGUFReader(path)
    assert read.data_offset == reference.data_offset
    for ref in reference.tensors:
        ours = read.tensors[ref.name]
        assert ours.ggml_type == ref.tensor_type
        assert ours.shape == tuple(int(d) for d in reversed(ref.shape))
        assert ours.data.tobytes() == ref.data.tobytes()
    for name, tensor in tensors.items():
        values = read.tensors[name].dequantize()
        assert values.dtype == np.float32
        if isinstance(tensor, tuple):
            raw, qtype = tensor
            assert np.array_equal(read.tensors[name].data, raw)
            assert np.array_equal(values, gguf.dequantize(raw, qtype))
        else:
            assert np.array_equal(values, tensor.astype(np.float32))


def test_reader_views_the_file_without_copying(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    _write(path, [], {"w": np.arange(64, dtype=np.float32).reshape(2, 32)})
    read = read_gguf(path)
    tensor = read.tensors["w"]
    assert tensor.data.base is not None and not tensor.data.flags.owndata
    assert np.shares_memory(tensor.dequantize(), tensor.data)
    tensor.dequantize()[0, 0] = -1.0  # a private mapping: the file stays as written
    assert read_gguf(path).tensors["w"].dequantize()[0, 0] == 0.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a GGUF file"),
        (b"PK\x03\x04" + bytes(20), "not a GGUF file"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "version 1"),
        (b"GGUF" + (3).to_bytes(4, "big") + bytes(16), "big-endian"),
        (b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") + bytes(8), "count"),
    ],
)
def test_reader_rejects_what_it_cannot_read(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message):
        read_gguf(path)


def test_reader_rejects_truncated_files(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    _write(path, METADATA, _sample_tensors())
    whole = path.read_bytes()
    # the file ends in the last tensor's data and at most 31 bytes of padding
    for size in (12, 30, 200, len(whole) // 2, len(whole) - 40):
        path.write_bytes(whole[:size])
        with pytest.raises(GGUFError):
            read_gguf(path)


# ---- tiny llama files against transformers ---------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 64, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# "3 4" ranks above "1 2", so "1234" tokenizes differently when a split cuts it after three digits
MERGES = ["3 4", "1 2", "Ġ t", "h e", "Ġt he", "Ġ Ġ", "i n", "Ġ c", "Ġc at", "a t", "ĠĠ ĠĠ"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_TEXTS = [
    "the cat sat in the hat",
    " the  cat\n\n\tin 1234 and 12345678",
    "<|im_start|>user\nhello<|im_end|>\n",
    "<think>x</think> 🙂 naïve 日本語   ",
    "",
    "   ",
]


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from half-split rotary pairs to interleaved."""
    rows = weight.shape[0]
    halves = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def _write_tiny_llama(
    path: Path,
    pre: str,
    extra_metadata: list[tuple[str, Any, V, V | None]] | None = None,
    extra_tensors: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """A two-layer llama with a byte-level vocabulary; returns the float32 weights that went in
    unquantized, under Hugging Face names and in Hugging Face's row order."""
    alphabet = list(bytes_to_unicode().values())
    tokens = CONTROL + alphabet + ["<think>", "</think>"] + [m.replace(" ", "") for m in MERGES]
    token_types = [3] * len(CONTROL) + [1] * len(alphabet) + [4, 4] + [1] * len(MERGES)
    metadata: list[tuple[str, Any, V, V | None]] = [
        ("general.name", "tiny", V.STRING, None),
        ("llama.block_count", LAYERS, V.UINT32, None),
        ("llama.context_length", 256, V.UINT32, None),
        ("llama.embedding_length", HIDDEN, V.UINT32, None),
        ("llama.feed_forward_length", FFN, V.UINT32, None),
        ("llama.attention.head_count", HEADS, V.UINT32, None),
        ("llama.attention.head_count_kv", KV_HEADS, V.UINT32, None),
        ("llama.rope.freq_base", 500000.0, V.FLOAT32, None),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32, None),
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.pre", pre, V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", token_types, V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", MERGES, V.ARRAY, V.STRING),
        ("tokenizer.ggml.bos_token_id", 1, V.UINT32, None),
        ("tokenizer.ggml.eos_token_id", 2, V.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", 0, V.UINT32, None),
        ("tokenizer.ggml.add_bos_token", True, V.BOOL, None),
        ("tokenizer.chat_template", TINY_TEMPLATE, V.STRING, None),
    ]
    rng = np.random.default_rng(1)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32)

    vocab = len(tokens)
    exact = {
        "model.embed_tokens.weight": matrix(vocab, HIDDEN),
        "lm_head.weight": matrix(vocab, HIDDEN),
    }
    tensors: dict[str, Any] = {
        "token_embd.weight": exact["model.embed_tokens.weight"],
        "output.weight": exact["lm_head.weight"],
        "output_norm.weight": matrix(1, HIDDEN)[0],
    }
    for layer in range(LAYERS):
        q, k = matrix(HEADS * HEAD_DIM, HIDDEN), matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        q_gguf, k_gguf = _llama_cpp_permute(q, HEADS), _llama_cpp_permute(k, KV_HEADS)
        prefix = f"blk.{layer}"
        if layer == 0:  # float: our un-permuted rows must give back exactly what went in
            exact[f"model.layers.{layer}.self_attn.q_proj.weight"] = q
            tensors[f"{prefix}.attn_q.weight"] = q_gguf
            tensors[f"{prefix}.attn_k.weight"] = k_gguf.astype(np.float16)
            exact[f"model.layers.{layer}.self_attn.k_proj.weight"] = k.astype(np.float16)
        else:
            tensors[f"{prefix}.attn_q.weight"] = (gguf.quantize(q_gguf, Q.Q8_0), Q.Q8_0)
            tensors[f"{prefix}.attn_k.weight"] = (gguf.quantize(k_gguf, Q.Q4_0), Q.Q4_0)
        tensors[f"{prefix}.attn_v.weight"] = matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[f"{prefix}.attn_output.weight"] = (
            gguf.quantize(matrix(HIDDEN, HIDDEN), Q.Q8_0),
            Q.Q8_0,
        )
        tensors[f"{prefix}.attn_norm.weight"] = matrix(1, HIDDEN)[0]
        tensors[f"{prefix}.ffn_norm.weight"] = matrix(1, HIDDEN)[0]
        tensors[f"{prefix}.ffn_gate.weight"] = matrix(FFN, HIDDEN)
        tensors[f"{prefix}.ffn_up.weight"] = (gguf.quantize(matrix(FFN, HIDDEN), Q.Q4_1), Q.Q4_1)
        tensors[f"{prefix}.ffn_down.weight"] = matrix(HIDDEN, FFN).astype(np.float16)
    _write(path, metadata + (extra_metadata or []), {**tensors, **(extra_tensors or {})})
    return exact


def _transformers_config(path: Path) -> Any:
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def _transformers_tensors(path: Path, hf: Any) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    return dict(parsed["tensors"])


def _transformers_tokenizer(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def _assert_same_tokenizer(ours: Any, reference: Any, texts: list[str]) -> None:
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.all_special_ids == reference.all_special_ids
    with_specials = ours(texts)["input_ids"]
    assert with_specials == reference(texts)["input_ids"]
    plain = ours(texts, add_special_tokens=False)["input_ids"]
    assert plain == reference(texts, add_special_tokens=False)["input_ids"]
    for ids in with_specials:
        for skip in (False, True):
            decoded = ours.decode(ids, skip_special_tokens=skip)
            assert decoded == reference.decode(ids, skip_special_tokens=skip)
    for ids, text in zip(plain, texts, strict=True):
        assert ours.decode(ids) == text


@pytest.fixture(params=["smollm", "llama-bpe"])
def tiny_llama(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, _write_tiny_llama(path, request.param)


def test_tiny_llama_config_and_weights_match_transformers(
    tiny_llama: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, exact = tiny_llama
    parsed = read_gguf(path)
    assert supports(parsed)
    config = ModelConfig.from_hf(hf_config(parsed))
    reference_config = _transformers_config(path)
    assert config == ModelConfig.from_hf(reference_config)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)

    ours = dict(llama_tensors(parsed, config))
    reference = _transformers_tensors(path, reference_config)
    assert sorted(ours) == sorted(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
    for name, weight in exact.items():
        assert torch.equal(ours[name], torch.from_numpy(weight.astype(np.float32))), name

    loaded = load_model(str(path), "cpu", torch.float32)
    assert loaded.config == config
    assert torch.equal(loaded.model.lm_head.weight, ours["lm_head.weight"])


def test_tiny_llama_tokenizer_matches_transformers(
    tiny_llama: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, _ = tiny_llama
    parsed = read_gguf(path)
    ours, reference = load_tokenizer(parsed), _transformers_tokenizer(path)
    assert ours("x")["input_ids"][0] == 1  # the file asks for a BOS
    _assert_same_tokenizer(ours, reference, TINY_TEXTS)
    messages = [{"role": "user", "content": "the cat"}]
    for tokenize in (False, True):
        got = ours.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True)
        assert got == reference.apply_chat_template(
            messages, tokenize=tokenize, add_generation_prompt=True
        )


def test_pre_tokenizer_split_is_applied(tmp_path: Path) -> None:
    ids = {}
    for pre in ("smollm", "llama-bpe"):
        path = tmp_path / f"{pre}.gguf"
        _write_tiny_llama(path, pre)
        ids[pre] = load_tokenizer(read_gguf(path))("1234", add_special_tokens=False)["input_ids"]
    assert ids["smollm"] != ids["llama-bpe"]  # [12, 34] against [12, 3] + [4]


def test_only_the_plain_llama_layout_is_read_here(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, "smollm")
    parsed = read_gguf(path)

    def with_metadata(**changes: Any) -> GGUFFile:
        return dataclasses.replace(parsed, metadata={**parsed.metadata, **changes})

    assert supports(parsed)
    assert not supports(with_metadata(**{"general.architecture": "qwen2"}))
    assert not supports(with_metadata(**{"general.name": "Mistral-7B-Instruct"}))
    assert not supports(with_metadata(**{"llama.rope.scaling.type": "yarn"}))
    assert supports(with_metadata(**{"llama.rope.scaling.type": "linear"}))
    assert hf_name("blk.1.attn_q.bias") is None and hf_name("blk.x.attn_q.weight") is None
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"

    assert byte_level_tokenizer(with_metadata(**{"tokenizer.ggml.model": "llama"})) is None
    assert byte_level_tokenizer(with_metadata(**{"tokenizer.ggml.pre": "qwen2"})) is None


# ---- RoPE scaling, which transformers ignores in GGUF files -----------------------------------

# Llama 3.1's scaling with a short original context, so that the tiny head's four frequencies
# fall in all three bands (kept, blended, slowed down 8x)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
ROPE_THETA = 500000.0  # the tiny file's llama.rope.freq_base


def _llama_cpp_rope_freqs(scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel): one divisor per frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_from_rope_freqs_gives_the_configs_frequencies(
    tmp_path: Path,
) -> None:
    """A Llama 3.1 GGUF carries its "llama3" RoPE scaling as llama.cpp's `rope_freqs` tensor:
    loaded, it gives the inverse frequencies that the Hugging Face config's scaling gives
    (transformers' own, and ours), which differ from unscaled ones in two of the four."""
    path = tmp_path / "llama31.gguf"
    rope_freqs = _llama_cpp_rope_freqs(LLAMA3_ROPE)
    assert rope_freqs[0] == 1.0 and 1.0 < rope_freqs[1] < 8.0 and set(rope_freqs[2:]) == {8.0}
    context = [("llama.context_length", 2048, V.UINT32, None)]
    _write_tiny_llama(path, "llama-bpe", context, {"rope_freqs.weight": rope_freqs})
    parsed = read_gguf(path)
    assert supports(parsed)

    loaded = load_model(str(path), "cpu", torch.float32)
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling.rope_type is RopeType.FREQ_FACTORS
    assert loaded.config.max_context_len == 2048
    ours = loaded.model.rotary._inv_freq_cpu
    hf = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        max_position_embeddings=2048,
        rope_theta=ROPE_THETA,
        rope_scaling=LLAMA3_ROPE,
    )
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
    from_config = ModelConfig.from_hf(hf).rope_scaling
    torch.testing.assert_close(
        ours, rope_inv_freq(HEAD_DIM, ROPE_THETA, from_config), rtol=1e-6, atol=0
    )
    assert not torch.allclose(ours, rope_inv_freq(HEAD_DIM, ROPE_THETA, None))


def test_linear_rope_scaling_is_read_from_the_metadata(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    linear = [
        ("llama.rope.scaling.type", "linear", V.STRING, None),
        ("llama.rope.scaling.factor", 4.0, V.FLOAT32, None),
    ]
    _write_tiny_llama(path, "llama-bpe", linear)
    loaded = load_model(str(path), "cpu", torch.float32)
    assert loaded.config.rope_scaling == RopeScaling(RopeType.LINEAR, factor=4.0)
    unscaled = rope_inv_freq(HEAD_DIM, ROPE_THETA, None)
    torch.testing.assert_close(loaded.model.rotary._inv_freq_cpu, unscaled / 4)


def test_rope_scaling_not_read_here_is_refused_not_dropped(tmp_path: Path) -> None:
    """transformers would load the file without its scaling: every position past a few would
    be wrong, so the load fails instead."""
    path = tmp_path / "yarn.gguf"
    yarn = [
        ("llama.rope.scaling.type", "yarn", V.STRING, None),
        ("llama.rope.scaling.factor", 4.0, V.FLOAT32, None),
    ]
    _write_tiny_llama(path, "llama-bpe", yarn)
    with pytest.raises(ModelLoadError, match="RoPE scaling"):
        load_model(str(path), "cpu", torch.float32)


# ---- the real file (SmolLM2-135M-Instruct, Q4_1) ---------------------------------------------

NUM_SHAREGPT_TEXTS = 300
EXTRA_TEXTS = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<|im_end|>",
    "Emoji: 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ and text",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tif x  >= 10:\n\t\tpass\n",
    "Привет, мир! 你好，世界。 こんにちは 안녕하세요 مرحبا بالعالم שלום नमस्ते",
    "  leading spaces",
    "trailing spaces   ",
    "   ",
    "\n\n\n",
    "numbers 1234567890 3.14159 1,000,000 and    42",
    "MiXeD CaSe don't won't it's we'll they're I'm you've",
    "a" * 300,
]


@pytest.fixture(scope="module")
def smollm2() -> GGUFFile:
    return read_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def smollm2_hf_config(smollm2: GGUFFile) -> Any:
    return _transformers_config(smollm2.path)


@pytest.fixture(scope="module")
def sharegpt_texts() -> list[str]:
    texts = [m.text for conv in load_conversations("sharegpt", 100) for m in conv.turns]
    return [t for t in texts if t][:NUM_SHAREGPT_TEXTS]


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2: GGUFFile, smollm2_hf_config: Any) -> None:
    assert supports(smollm2)
    assert ModelConfig.from_hf(hf_config(smollm2)) == ModelConfig.from_hf(smollm2_hf_config)


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2: GGUFFile, smollm2_hf_config: Any) -> None:
    config = ModelConfig.from_hf(hf_config(smollm2))
    reference = _transformers_tensors(smollm2.path, smollm2_hf_config)
    names = []
    for name, tensor in llama_tensors(smollm2, config):
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
        names.append(name)
    assert sorted(names) == sorted(reference)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(
    smollm2: GGUFFile, sharegpt_texts: list[str]
) -> None:
    assert len(sharegpt_texts) == NUM_SHAREGPT_TEXTS
    ours, reference = load_tokenizer(smollm2), _transformers_tokenizer(smollm2.path)
    assert ours("x")["input_ids"] == ours("x", add_special_tokens=False)["input_ids"]
    _assert_same_tokenizer(ours, reference, sharegpt_texts + EXTRA_TEXTS)
    conversations = [
        [{"role": "user", "content": "Hi there!"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name  three   colours 🙂"},
            {"role": "assistant", "content": "Red, green, blue."},
            {"role": "user", "content": sharegpt_texts[0]},
        ],
    ]
    for messages in conversations:
        for tokenize in (False, True):
            for prompt in (False, True):
                got = ours.apply_chat_template(
                    messages, tokenize=tokenize, add_generation_prompt=prompt
                )
                expected = reference.apply_chat_template(
                    messages, tokenize=tokenize, add_generation_prompt=prompt
                )
                assert got == expected
