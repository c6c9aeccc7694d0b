"""One rank's share of a model, loaded for tensor parallelism: `load_shard(spec, device, dtype,
shard)`, the split counterpart of `load_model`.

A preset is built on the meta device and materialised piece by piece, each decoder layer split
as soon as its random weights are drawn: the device never holds more than one whole layer beside
the rank's share, and the weights are those of the same preset on one rank (the pieces draw from
one generator in `init_random_`'s order). A checkpoint is read whole on the CPU, split there,
and the share moved to the device.
"""

from __future__ import annotations

import torch
from torch import nn

from pensieve.models.loader import LoadedModel, fill_random_, load_model
from pensieve.models.tensor_parallel import (
    TensorShard,
    shard_layer,
    shard_model,
    shard_vocabulary,
    split_config,
)


def load_shard(
    spec: str, device: torch.device | str, dtype: torch.dtype, shard: TensorShard, seed: int = 0
) -> LoadedModel:
    """Rank `shard.rank`'s share of the model `spec` (see `load_model`) on `device`."""
    device = torch.device(device)
    if shard.world_size == 1:
        return load_model(spec, device, dtype, seed)
    if spec.startswith("preset:") and device.type != "meta":
        return _preset_shard(spec, device, dtype, shard, seed)
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
