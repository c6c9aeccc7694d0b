"""A llama-architecture GGUF file as what Pensieve loads: a ModelConfig, Hugging Face-named weights
and a tokenizer, all from one `read_gguf` parse.

transformers can do all three, but each of its entry points (AutoConfig, load_gguf_checkpoint,
AutoTokenizer) parses the file again through its own private GGUF helpers. This module reads the
plain llama layout only - the one llama.cpp writes for Llama 2/3/3.1 and SmolLM without biases or
experts - and `supports()` says so; the loader sends every other file through transformers, as
before. Where a file leaves a value out, the default is LlamaConfig's, so the two paths agree on
every file both accept.

RoPE scaling is read here and nowhere else (transformers ignores it in GGUF files): llama.cpp's
converter stores Llama 3.1's "llama3" scaling as a `rope_freqs` tensor of per-frequency divisors,
and linear scaling as `llama.rope.scaling.type` "linear" with its factor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from pensieve.models.config import ModelConfig, RopeScaling, RopeType
from pensieve.models.gguf import GGUFFile

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE divisors
# `llama.rope.scaling.type` values read here; any other stays with transformers
_ROPE_SCALING_TYPES = ("none", "linear")

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_REQUIRED = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")

# llama.cpp's CONTROL token type: <|endoftext|>, <|im_start|>, ...; USER_DEFINED: <think>, ...
_CONTROL, _USER_DEFINED = 3, 4

# How byte-level vocabularies split text before BPE, by `tokenizer.ggml.pre`. None is GPT-2's own
# regex, built into tokenizers' ByteLevel. For "smollm" that is what transformers builds (and what
# the model is compared against); llama.cpp also cuts every digit off first, which differs only
# where two or more spaces precede a digit ("x  1": "Ġ", "Ġ", "1" here, "ĠĠ", "1" there).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, str | None] = {
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
}


def supports(gguf: GGUFFile) -> bool:
    """True when this module reads `gguf` exactly as transformers would.

    A "llama" file whose name says Mistral becomes a Mistral config in transformers (with its
    sliding window), so it stays with transformers; so does a rope scaling type other than
    linear (which transformers ignores: see `has_rope_scaling`).
    """
    md = gguf.metadata
    if md.get("general.architecture") != "llama":
        return False
    if "mistral" in str(md.get("general.name", "")).lower():
        return False
    if md.get("llama.rope.scaling.type", "none") not in _ROPE_SCALING_TYPES:
        return False
    if any(f"llama.{key}" not in md for key in _REQUIRED):
        return False
    if "llama.vocab_size" not in md and "tokenizer.ggml.tokens" not in md:
        return False
    return all(hf_name(name) is not None or name == ROPE_FREQS for name in gguf.tensors)


def has_rope_scaling(gguf: GGUFFile) -> bool:
    """Whether the file scales RoPE, which transformers' GGUF loading would silently drop."""
    scaling_type = gguf.metadata.get(
        f"{gguf.metadata.get('general.architecture')}.rope.scaling.type"
    )
    return ROPE_FREQS in gguf.tensors or scaling_type not in (None, "none")


def model_config(gguf: GGUFFile) -> ModelConfig:
    """The file's ModelConfig: `hf_config`'s, with the RoPE scaling the file stores.
    ValueError if the file's values are not a model we run."""
    return dataclasses.replace(
        ModelConfig.from_hf(hf_config(gguf)), rope_scaling=rope_scaling(gguf)
    )


def rope_scaling(gguf: GGUFFile) -> RopeScaling | None:
    """RoPE scaling as llama.cpp applies it: each frequency divided by its `rope_freqs` factor
    and by the linear factor, if the file has either."""
    md = gguf.metadata
    linear = 1.0
    if md.get("llama.rope.scaling.type", "none") == "linear":
        linear = float(md.get("llama.rope.scaling.factor", 1.0))
    freqs = gguf.tensors.get(ROPE_FREQS)
    if freqs is None:
        return None if linear == 1.0 else RopeScaling(RopeType.LINEAR, factor=linear)
    factors = freqs.dequantize().reshape(-1).astype(np.float64) * linear
    return RopeScaling(RopeType.FREQ_FACTORS, freq_factors=tuple(float(f) for f in factors))


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor, or None for one outside the plain layout."""
    base, _, kind = gguf_name.rpartition(".")
    if kind != "weight":
        return None
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.weight"
    return None


def hf_config(gguf: GGUFFile) -> SimpleNamespace:
    """A stand-in for transformers' LlamaConfig, for `ModelConfig.from_hf`: the keys transformers
    would set from this file, and nothing else."""
    md = gguf.metadata
    heads = int(md["llama.attention.head_count"])
    tokens = md.get("tokenizer.ggml.tokens")
    return SimpleNamespace(
        model_type="llama",
        vocab_size=md.get("llama.vocab_size") or len(tokens or ()),
        hidden_size=md["llama.embedding_length"],
        intermediate_size=md["llama.feed_forward_length"],
        num_hidden_layers=md["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=md.get("llama.attention.head_count_kv", heads),
        head_dim=md.get("llama.rope.dimension_count"),  # None: hidden_size // heads
        max_position_embeddings=md.get("llama.context_length", 2048),
        rms_norm_eps=md.get("llama.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=md.get("llama.rope.freq_base", 10000.0),
        hidden_act="silu",
        # llama.cpp writes the output projection only when it is not the embedding matrix
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id", 1),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id", 2),
        name_or_path=str(md.get("general.name") or gguf.path.stem),
    )


def tensor_shapes(gguf: GGUFFile) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor `llama_tensors` yields, by its Hugging Face name, in order."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in gguf.tensors.items():
        if name == ROPE_FREQS:
            continue
        target = hf_name(name)
        if target is None:
            raise ValueError(f"{gguf.path}: tensor {name} is not part of the llama layout")
        shapes[target] = tensor.shape
    return shapes


def llama_tensors(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Float32 tensors under Hugging Face names, one at a time (one dequantized copy at most).

    llama.cpp's converter permutes the rows of q and k within each head from Hugging Face's
    half-split rotary layout to interleaved pairs; this undoes it, as transformers does.
    """
    for name, tensor in gguf.tensors.items():
        if name == ROPE_FREQS:  # part of the config (`rope_scaling`), not a weight
            continue
        target = hf_name(name)
        if target is None:
            raise ValueError(f"{gguf.path}: tensor {name} is not part of the llama layout")
        values = tensor.dequantize()
        if target.endswith("self_attn.q_proj.weight"):
            values = _unpermute_rows(values, config.num_heads)
        elif target.endswith("self_attn.k_proj.weight"):
            values = _unpermute_rows(values, config.num_kv_heads)
        yield target, torch.from_numpy(values)


def _unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    pairs = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2)).reshape(weight.shape)


def load_tokenizer(gguf: GGUFFile) -> Any:
    """The file's tokenizer: built here for a byte-level BPE vocabulary with a known
    pre-tokenizer, else by transformers' AutoTokenizer (which parses the file again)."""
    tokenizer = byte_level_tokenizer(gguf)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    folder, name = gguf.path.parent, gguf.path.name
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def byte_level_tokenizer(gguf: GGUFFile) -> Any | None:
    """A transformers fast tokenizer for a byte-level BPE vocabulary (`tokenizer.ggml.model`
    "gpt2") with a pre-tokenizer listed in `_PRE_SPLITS`; None for any other."""
    md = gguf.metadata
    pre = md.get("tokenizer.ggml.pre", "gpt-2")
    if md.get("tokenizer.ggml.model") != "gpt2" or pre not in _PRE_SPLITS:
        return None
    if "tokenizer.ggml.tokens" not in md or "tokenizer.ggml.merges" not in md:
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = md["tokenizer.ggml.tokens"]
    token_types: list[int] = md.get("tokenizer.ggml.token_type") or []
    spelled = [_byte_level_spelling(token) for token in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    merges = [
        (left, right) for left, _, right in (m.partition(" ") for m in md["tokenizer.ggml.merges"])
    ]
    backend = Tokenizer(
        BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_SPLITS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # A marked token spelled outside the byte alphabet is a mislabel: adding it as written would
    # give it a second id past the model's vocabulary, so only byte-level spellings are added.
    marked = [(t, kind) for t, kind in zip(tokens, token_types, strict=False) if t in vocab]
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in marked if kind == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in marked
            if kind == _USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        index = md.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if any(on and ":" in str(t) for t, on in ((bos, add_bos), (eos, add_eos))):
        return None  # a template piece is "TOKEN:TYPE_ID", so such a token cannot be named in one

    def template(sequence: str, type_id: int) -> list[str]:
        head = [f"{bos}:{type_id}"] if add_bos else []
        tail = [f"{eos}:{type_id}"] if add_eos else []
        return [*head, f"{sequence}:{type_id}", *tail]

    ids = {"tokenizer.ggml.bos_token_id": add_bos, "tokenizer.ggml.eos_token_id": add_eos}
    backend.post_processor = processors.TemplateProcessing(
        single=template("$A", 0),
        pair=template("$A", 0) + template("$B", 1),
        special_tokens=[(tokens[md[key]], md[key]) for key, on in ids.items() if on],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=md.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
    """GPT-2's printable spelling of the 256 bytes: printable Latin-1 bytes stand for themselves,
    the other 68 (controls, space, ...) map in order to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in spelling)
    spelling.update({byte: chr(0x100 + n) for n, byte in enumerate(others)})
    return spelling, frozenset(spelling.values())


def _byte_level_spelling(token: str) -> str:
    """`token` in the byte alphabet: as stored when it already is, else its UTF-8 bytes spelled."""
    spelling, alphabet = _byte_alphabet()
    if alphabet.issuperset(token):
        return token
    return "".join(spelling[byte] for byte in token.encode("utf-8"))
