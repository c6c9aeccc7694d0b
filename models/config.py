"""ModelConfig: the one description of a model's shape that every other part of Pensieve reads.

Built from a Hugging Face config (`ModelConfig.from_hf`) or from a named preset (presets.py).
Two families are covered:

- `Arch.LLAMA`: Llama 2/3, Mistral, Qwen2/2.5 (QKV bias) and Qwen3 (per-head RMS QK-norm):
  pre-norm RMSNorm blocks, RoPE, SwiGLU MLP, grouped-query attention.
- `Arch.OPT`: learned positions (offset 2), LayerNorm, ReLU MLP, biases everywhere.

Sliding-window attention (Mistral, Qwen2 with `use_sliding_window`) is not implemented: the models
attend to the whole context, which is exact as long as no sequence is longer than the window.
`max_context_len` is therefore capped at the window, and the engine must not exceed it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class Arch(enum.Enum):
    LLAMA = "llama"  # also Mistral, Qwen2, Qwen3
    OPT = "opt"


class RopeType(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    # one divisor per frequency, as llama.cpp stores any such scaling in a GGUF (`rope_freqs`)
    FREQ_FACTORS = "freq_factors"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `LLAMA3` uses the first five fields; `LINEAR` only `factor`;
    `FREQ_FACTORS` only `freq_factors` (head_dim / 2 of them)."""

    rope_type: RopeType
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type is RopeType.LLAMA3 and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
        if self.rope_type is RopeType.FREQ_FACTORS and not all(f > 0 for f in self.freq_factors):
            raise ValueError("rope frequency factors must all be > 0")
        if (self.rope_type is RopeType.FREQ_FACTORS) != bool(self.freq_factors):
            raise ValueError("freq_factors go with rope_type FREQ_FACTORS, and only with it")


# model_type values of Hugging Face configs that `from_hf` understands
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "opt")

OPT_POSITION_OFFSET = 2  # OPT's learned position table has two extra leading rows


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2; OPT
    o_bias: bool = False  # Llama `attention_bias`; OPT
    mlp_bias: bool = False  # Llama `mlp_bias`; OPT
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # not applied; caps max_context_len (see module doc)
    do_layer_norm_before: bool = True  # OPT only: False = post-norm blocks, no final norm
    # ranks the model is split over (models/tensor_parallel.py); the shapes above stay the whole
    # model's, the `*_per_rank` properties and the KV cache shape are one rank's
    tensor_parallel_size: int = 1
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, attr) < 1:
                raise ValueError(f"{attr} must be >= 1, got {getattr(self, attr)}")
        for attr in ("num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, attr) < 1:
                raise ValueError(f"{attr} must be >= 1, got {getattr(self, attr)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.arch is Arch.LLAMA:
            self._check_llama()
        else:
            self._check_opt()
        self._check_tensor_parallel()

    def _check_llama(self) -> None:
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        factors = self.rope_scaling.freq_factors if self.rope_scaling else ()
        if factors and len(factors) != self.head_dim // 2:
            raise ValueError(
                f"{len(factors)} rope frequency factors for head_dim {self.head_dim} "
                f"(one per pair of dimensions: {self.head_dim // 2})"
            )
        if not self.do_layer_norm_before:
            raise ValueError("do_layer_norm_before=False is an OPT option")

    def _check_opt(self) -> None:
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                "OPT has no grouped-query attention: num_kv_heads must equal num_heads"
            )
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError("OPT needs num_heads * head_dim == hidden_size")
        if self.qk_norm or self.rope_scaling is not None:
            raise ValueError("qk_norm and rope_scaling are Llama-family options, not OPT")

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
        # each rank holds whole KV heads (its share of every KV block) and the query heads that
        # read them; MLP columns split evenly (the vocabulary is padded instead)
        for what, count in (
            ("KV heads", self.num_kv_heads),
            ("query heads", self.num_heads),
            ("MLP columns (intermediate_size)", self.intermediate_size),
        ):
            if count % n:
                raise ValueError(
                    f"{self.name}: its {count} {what} do not divide over {n} tensor-parallel "
                    f"ranks; choose a tensor-parallel size that divides {count}"
                )

    # ---- derived quantities the engine needs -------------------------------------------------

    @property
    def num_heads_per_rank(self) -> int:
        return self.num_heads // self.tensor_parallel_size

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tensor_parallel_size

    @property
    def intermediate_size_per_rank(self) -> int:
        return self.intermediate_size // self.tensor_parallel_size

    @property
    def vocab_size_per_rank(self) -> int:
        """Rows of the embedding and LM head on each rank: the vocabulary padded to a multiple
        of the ranks (padded logits are dropped when the shards are gathered)."""
        return -(-self.vocab_size // self.tensor_parallel_size)

    @property
    def attn_scale(self) -> float:
        """Softmax scale to pass to the attention backend."""
        return float(self.head_dim) ** -0.5

    @property
    def max_context_len(self) -> int:
        """Longest sequence this model computes exactly (positions and sliding window)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged KV cache on one rank (see kernels/metadata.py)."""
        return (num_blocks, 2, block_size, self.num_kv_heads_per_rank, self.head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers, on one rank."""
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return 2 * self.num_layers * self.num_kv_heads_per_rank * self.head_dim * itemsize

    # ---- construction from a Hugging Face config ---------------------------------------------

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers `PretrainedConfig`. Raises ValueError if unsupported."""
        model_type = getattr(hf, "model_type", None)
        if model_type == "opt":
            return _opt_from_hf(hf)
        if model_type in ("llama", "mistral", "qwen2", "qwen3"):
            return _llama_from_hf(hf, model_type)
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


class WeightSlot(NamedTuple):
    """Where one checkpoint tensor goes: rows [start, stop) of dim 0 of parameter `param`.

    Fused parameters (QKV, gate/up) receive several checkpoint tensors, one slot each.
    """

    param: str
    start: int
    stop: int


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(hf: Any) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 keeps everything in `rope_parameters`; 4.x has rope_theta + rope_scaling
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = float(params["rope_theta"]), params
    else:
        theta = float(getattr(hf, "rope_theta", None) or 10000.0)
        scaling = getattr(hf, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(RopeType.LINEAR, factor=float(scaling["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            RopeType.LLAMA3,
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            # transformers falls back to max_position_embeddings where this is left out
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings") or hf.max_position_embeddings
            ),
        )
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _sliding_window(hf: Any) -> int | None:
    if not getattr(hf, "use_sliding_window", True):  # Qwen2/3 carry a window they do not use
        return None
    window = getattr(hf, "sliding_window", None)
    return int(window) if window else None


def _llama_from_hf(hf: Any, model_type: str) -> ModelConfig:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: unsupported hidden_act {act!r} (only silu)")
    theta, scaling = _rope_from_hf(hf)
    num_heads = int(hf.num_attention_heads)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or num_heads),
        head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads),
        max_position_embeddings=int(hf.max_position_embeddings),
        norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(hf, "eos_token_id", None)),
        sliding_window=_sliding_window(hf),
        name=str(getattr(hf, "name_or_path", "") or model_type),
    )


def _opt_from_hf(hf: Any) -> ModelConfig:
    proj_dim = getattr(hf, "word_embed_proj_dim", None)
    if proj_dim is not None and proj_dim != hf.hidden_size:
        raise ValueError(
            f"opt: word_embed_proj_dim={proj_dim} != hidden_size={hf.hidden_size} "
            "(project_in/project_out, as in opt-350m) is not supported"
        )
    if getattr(hf, "activation_function", "relu") != "relu":
        raise ValueError(f"opt: unsupported activation_function {hf.activation_function!r}")
    if not getattr(hf, "layer_norm_elementwise_affine", True):
        raise ValueError("opt: layer_norm_elementwise_affine=False is not supported")
    if getattr(hf, "_remove_final_layer_norm", False):
        raise ValueError("opt: _remove_final_layer_norm=True is not supported")
    bias = bool(getattr(hf, "enable_bias", True))
    num_heads = int(hf.num_attention_heads)
    return ModelConfig(
        arch=Arch.OPT,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.ffn_dim),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=int(hf.hidden_size) // num_heads,
        max_position_embeddings=int(hf.max_position_embeddings),
        norm_eps=1e-5,  # torch.nn.LayerNorm's default, which OPT uses
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(hf, "eos_token_id", None)),
        do_layer_norm_before=bool(hf.do_layer_norm_before),
        name=str(getattr(hf, "name_or_path", "") or "opt"),
    )
