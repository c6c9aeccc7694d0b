"""One rank's share of a model, loaded for tensor parallelism: `load_shard(spec, device, dtype,
shard)`, the split counterpart of `load_model`.

A preset is built on the meta device and materialised piece by piece, each decoder layer split
as soon as its random weights are drawn: the device never holds more than one whole layer beside
the rank's share, and the weights are those of the same preset on one rank (the pieces draw from
one generator in `init_random_`'s order). A Hugging Face folder is split tensor by tensor as it
is read: each rank keeps its rows or columns of each checkpoint tensor, so no process holds the
whole model. A GGUF file is read whole on the CPU, split there, and the share moved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from pensieve.models.config import WeightSlot
from pensieve.models.loader import (
    CausalLM,
    LoadedModel,
    build_model,
    canonical_name,
    fill_random_,
    folder_tokenizer,
    hf_folder_config,
    load_model,
    load_weights,
    safetensors_tensors,
)
from pensieve.models.tensor_parallel import (
    RowParallelLinear,
    TensorShard,
    VocabParallelEmbedding,
    shard_layer,
    shard_model,
    shard_vocabulary,
    split_config,
)


def _rows(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return tensor[start:stop]


def load_shard(
    spec: str, device: torch.device | str, dtype: torch.dtype, shard: TensorShard, seed: int = 0
) -> LoadedModel:
    """Rank `shard.rank`'s share of the model `spec` (see `load_model`) on `device`."""
    device = torch.device(device)
    if shard.world_size == 1:
        return load_model(spec, device, dtype, seed)
    if spec.startswith("preset:") and device.type != "meta":
        return _preset_shard(spec, device, dtype, shard, seed)
    if Path(spec).expanduser().is_dir() and device.type != "meta":
        return _folder_shard(Path(spec).expanduser(), device, dtype, shard)
    loaded = load_model(spec, "cpu" if device.type != "meta" else device, dtype, seed)
    model = shard_model(loaded.model, shard).to(device)
    return LoadedModel(model, model.config, loaded.tokenizer)


@torch.no_grad()
def _preset_shard(
    spec: str, device: torch.device, dtype: torch.dtype, shard: TensorShard, seed: int
) -> LoadedModel:
    model = load_model(spec, "meta", dtype).model
    config = split_config(model.config, shard)  # a clear error before anything is drawn
    generator = torch.Generator(device=device).manual_seed(seed)
    for child in model.children():  # in the order of the model's parameters
        for part in child if isinstance(child, nn.ModuleList) else [child]:
            part.to_empty(device=device)
            fill_random_(part.named_parameters(), generator)
            if child is model.layers:
                shard_layer(part, config, shard)
    shard_vocabulary(model, config, shard)
    return LoadedModel(model, config, None)


@torch.no_grad()
def _folder_shard(
    path: Path, device: torch.device, dtype: torch.dtype, shard: TensorShard
) -> LoadedModel:
    model = build_model(hf_folder_config(path), "meta", dtype)
    whole_slots = model.hf_weight_map()
    whole_rows = {name: p.shape[0] for name, p in model.named_parameters()}
    shard_model(model, shard)
    model.to_empty(device=device)
    for table in (model.embed_tokens, model.lm_head):  # the padding rows of the vocabulary
        if table is not None:
            table.weight.zero_()
    split = _Split(model, whole_slots, whole_rows, shard)
    load_weights(model, split.pieces(safetensors_tensors(path)), str(path), split.slots)
    return LoadedModel(model, model.config, folder_tokenizer(path))


class _Split:
    """Where this rank's piece of each checkpoint tensor goes (`slots`), and the piece."""

    def __init__(
        self,
        model: CausalLM,
        whole_slots: dict[str, WeightSlot],
        whole_rows: dict[str, int],
        shard: TensorShard,
    ) -> None:
        self.config = model.config
        self.slots: dict[str, WeightSlot] = {}
        self.cuts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.dropped: set[str] = set()  # tensors another rank alone holds
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())
        n, r = shard.world_size, shard.rank
        for name, slot in whole_slots.items():
            owner, _, kind = slot.param.rpartition(".")
            module = modules[owner]
            if isinstance(module, RowParallelLinear) and kind == "bias" and module.bias is None:
                self.dropped.add(name)
            elif isinstance(module, RowParallelLinear) and kind == "weight":
                self.slots[name] = slot
                self.cuts[name] = lambda t: t[:, shard.rows(t.shape[1])]
            elif isinstance(module, VocabParallelEmbedding) or owner == "lm_head":
                per_rank = self.config.vocab_size_per_rank
                start = r * per_rank
                held = max(0, min(per_rank, self.config.vocab_size - start))
                self.slots[name] = WeightSlot(slot.param, 0, held)
                self.cuts[name] = functools.partial(_rows, start=start, stop=start + held)
            elif params[slot.param].shape[0] * n == whole_rows[slot.param]:  # column-parallel
                size = (slot.stop - slot.start) // n
                self.slots[name] = WeightSlot(slot.param, slot.start // n, slot.start // n + size)
                self.cuts[name] = functools.partial(_rows, start=r * size, stop=(r + 1) * size)
            else:  # the same on every rank
                self.slots[name] = slot

    def pieces(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for raw_name, tensor in tensors:
            name = canonical_name(raw_name, self.config)
            if name in self.dropped:
                continue
            cut = self.cuts.get(name)
            yield raw_name, tensor if cut is None else cut(tensor)
