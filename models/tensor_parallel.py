"""Tensor parallelism as a transform of a built model: `shard_model(model, shard)` keeps rank r's
share of every weight and swaps in the few modules that talk to the other ranks, so the model
code never branches on it (gpt-fast's way). Megatron-LM's split, per layer:

    qkv_proj, gate_up_proj, fc1       column-parallel: rank r keeps the rows of its query heads,
                                      its KV heads (which its queries read) and its MLP columns
    o_proj, down_proj, out_proj, fc2  row-parallel: the matching input columns; the partial sums
                                      meet in one all-reduce after attention, one after the MLP
    embed_tokens                      vocabulary-parallel: rank r looks up its rows, the others'
                                      tokens give zeros, an all-reduce sums them
    logits                            vocabulary-parallel: rank r's rows of the head, then an
                                      all-gather: every rank holds all the logits

Norms, rotary tables and OPT's learned positions stay whole on every rank. The KV cache of a
rank holds its KV heads of every block (`ModelConfig.kv_cache_shape`), so the scheduler's block
tables and swap orders are the same for every rank. The collectives go through
torch.distributed on whatever backend the group has: NCCL on GPUs, gloo on CPUs in tests. With the
"peer" mode, the row-parallel sums on GPUs go through symmetric memory instead
(`AllReduce`): each rank stages its partial sum in a buffer every rank can read over NVLink, and
one kernel adds them (no multicast).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pensieve.models.config import ModelConfig
from pensieve.models.llama import LlamaLayer
from pensieve.models.loader import CausalLM
from pensieve.models.opt import OPTLayer

# set in every process of a group before its first communicator: NVLink multicast stays off (on
# shared GPU hosts a program using it can take the host's GPUs out of service)
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# how the row-parallel layers sum their partial products: "nccl" (the process group's own
# all-reduce) or "peer" (symmetric memory on GPUs, the group's own for what does not fit)
ALL_REDUCE_MODES = ("nccl", "peer")
PEER_MAX_BYTES = 8 << 20  # the staging buffer: a decode step's sums fit many times over
ONE_SHOT_MAX_BYTES = 2 << 20  # up to here each rank reads all the others' (one shot)
PEER_DTYPES = (torch.float32, torch.bfloat16)  # what the symmetric-memory kernels add

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorShard:
    """Which part of the model this process holds: rank `rank` of `world_size`; `group` is the
    torch.distributed process group of the ranks (None: the default group)."""

    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")

    def rows(self, total: int) -> slice:
        """This rank's share of `total` rows (`total` divides by the world size)."""
        size = total // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)


class AllReduce:
    """The in-place sum over a group's ranks of a tensor: the group's own all-reduce, until
    `enable_peer` gives it a symmetric-memory buffer; then, on the GPU, a tensor of a supported
    dtype that fits is staged there and summed by one kernel of torch's symmetric memory: one
    shot (every rank reads every other's staged copy) for small sums, two shots (each rank sums
    its slice, then every rank gathers the slices) for larger ones. Both can be captured in a
    CUDA graph. One per process group (`reducer`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.buffer: torch.Tensor | None = None  # bytes every rank of the group can read
        self.group_name = ""

    def enable_peer(self, device: torch.device) -> bool:
        """Allocate the buffer and exchange it with the group's other ranks (a collective:
        every rank calls it, before any CUDA graph is captured); whether every rank has it.
        A rank that cannot (no symmetric memory in this torch, no peer access) leaves every
        rank on the group's own all-reduce."""
        if self.buffer is not None:
            return True
        group = self.group if self.group is not None else dist.group.WORLD
        assert group is not None, "the process group exists before its buffer"
        buffer, reason = None, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # torch before 2.8 asks first
                symm_mem.enable_symm_mem_for_group(group.group_name)
            buffer = symm_mem.empty(PEER_MAX_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group.group_name)
        except Exception as error:  # any failure falls back, on every rank
            buffer, reason = None, f"{type(error).__name__}: {error}"
        everyone = torch.tensor([buffer is not None], dtype=torch.int32, device=device)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.group)
        if not everyone.item():
            logger.warning(
                "peer all-reduce unavailable (%s); using %s",
                reason or "another rank could not",
                dist.get_backend(group),
            )
            return False
        self.buffer, self.group_name = buffer, group.group_name
        return True

    def __call__(self, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if (
            self.buffer is None
            or tensor.dtype not in PEER_DTYPES
            or size > PEER_MAX_BYTES
            or not tensor.is_contiguous()
        ):
            dist.all_reduce(tensor, group=self.group)
            return
        flat = tensor.view(-1)
        staged = self.buffer[:size].view(tensor.dtype)
        staged.copy_(flat)
        if size <= ONE_SHOT_MAX_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)


_REDUCERS: dict[Any, AllReduce] = {}


def reducer(group: Any) -> AllReduce:
    """This process's `AllReduce` of `group` (None: the default group)."""
    return _REDUCERS.setdefault(group, AllReduce(group))


def prepare_all_reduce(shard: TensorShard, device: torch.device, mode: str = "nccl") -> str:
    """Set up the row-parallel sums of this rank in `mode` (one of ALL_REDUCE_MODES; every rank
    of the group calls it at the same point, before capturing graphs); the mode in use."""
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"all-reduce mode {mode!r}: one of {', '.join(ALL_REDUCE_MODES)}")
    wanted = mode == "peer" and device.type == "cuda" and shard.world_size > 1
    if wanted and reducer(shard.group).enable_peer(device):
        return "peer"
    return "nccl" if device.type == "cuda" else "gloo"


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input columns: the partial products of all ranks summed
    by one all-reduce. The bias is added on rank 0 alone, so the sum holds it once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / N]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.reduce = reducer(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / N] -> [T, out], the same on every rank
        out = F.linear(x, self.weight, self.bias)
        self.reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding table; ids outside them give zeros here,
    and the all-reduce adds the row of the rank that holds each id."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / N (padded), hidden]
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        out.masked_fill_(outside[:, None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredLogits(nn.Module):
    """Each rank's logits over its vocabulary rows, gathered so every rank holds all of them
    (and samples the same tokens from them); the padding rows' logits are dropped."""

    def __init__(self, vocab_size: int, world_size: int, group: Any) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.world_size = world_size
        self.group = group

    def forward(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden], head: [V / N, hidden] -> [N, V] float32
        local = F.linear(hidden, head).float()  # [N, V / N]
        shards = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(shards, local, group=self.group)
        return torch.cat(shards, dim=-1)[:, : self.vocab_size]


def broadcast_from_first(tensor: torch.Tensor, shard: TensorShard) -> None:
    """Every rank's `tensor` becomes the first rank's (in place)."""
    group = shard.group if shard.group is not None else dist.group.WORLD
    assert group is not None, "torch.distributed is not initialized"
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=shard.group)


def shard_model(model: CausalLM, shard: TensorShard) -> CausalLM:
    """Keep rank `shard.rank`'s share of `model` (in place; also on the meta device, before any
    weight exists) and return it. Raises ValueError, naming the counts, when the model's heads
    or MLP columns do not divide over the ranks."""
    config = split_config(model.config, shard)
    if shard.world_size == 1:
        return model
    for layer in model.layers:
        shard_layer(layer, config, shard)
    shard_vocabulary(model, config, shard)
    return model


def split_config(config: ModelConfig, shard: TensorShard) -> ModelConfig:
    """The config of one rank's share of a model (ValueError if its heads do not divide)."""
    if config.tensor_parallel_size != 1:
        raise ValueError("the model is split over ranks already")
    return dataclasses.replace(config, tensor_parallel_size=shard.world_size)


def shard_layer(layer: nn.Module, config: ModelConfig, shard: TensorShard) -> None:
    """Keep this rank's share of one decoder layer; `config` is the rank's (`split_config`)."""
    if isinstance(layer, LlamaLayer):
        _shard_llama_layer(layer, config, shard)
    elif isinstance(layer, OPTLayer):
        _shard_opt_layer(layer, config, shard)
    else:
        raise TypeError(f"no tensor-parallel split for {type(layer).__name__}")


def shard_vocabulary(model: CausalLM, config: ModelConfig, shard: TensorShard) -> None:
    """Split the embedding, the LM head and the logits by vocabulary rows; the model's config
    becomes the rank's (its layers are split already)."""
    vocab = _vocab_rows(model.embed_tokens.weight, config, shard)
    model.embed_tokens = VocabParallelEmbedding(vocab, shard.rank * vocab.shape[0], shard.group)
    if model.lm_head is not None:
        _keep_rows(model.lm_head, _vocab_rows(model.lm_head.weight, config, shard))
    model.logits = GatheredLogits(config.vocab_size, shard.world_size, shard.group)
    model.config = config


def _shard_llama_layer(layer: LlamaLayer, config: ModelConfig, shard: TensorShard) -> None:
    attention, mlp = layer.attention, layer.mlp
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    # qkv_proj rows: [Q (Hq D) | K (Hkv D) | V (Hkv D)]; this rank's heads of each
    _split_columns(attention.qkv_proj, [q, kv, kv], shard)
    attention.o_proj = _row_parallel(attention.o_proj, shard)
    attention.num_heads = config.num_heads_per_rank
    attention.num_kv_heads = config.num_kv_heads_per_rank
    attention.q_size = config.num_heads_per_rank * config.head_dim
    attention.kv_size = config.num_kv_heads_per_rank * config.head_dim
    inter = config.intermediate_size
    _split_columns(mlp.gate_up_proj, [inter, inter], shard)  # rows: [gate (I) | up (I)]
    mlp.down_proj = _row_parallel(mlp.down_proj, shard)
    mlp.intermediate_size = config.intermediate_size_per_rank


def _shard_opt_layer(layer: OPTLayer, config: ModelConfig, shard: TensorShard) -> None:
    hidden = config.hidden_size
    _split_columns(layer.attention.qkv_proj, [hidden, hidden, hidden], shard)
    layer.attention.out_proj = _row_parallel(layer.attention.out_proj, shard)
    layer.attention.num_heads = config.num_heads_per_rank
    _split_columns(layer.fc1, [config.intermediate_size], shard)
    layer.fc2 = _row_parallel(layer.fc2, shard)


def _split_columns(linear: nn.Linear, parts: list[int], shard: TensorShard) -> None:
    """Column-parallel: of each of the fused outputs `parts` (rows of the weight, in order),
    keep this rank's share."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    rows = [
        slice(start + shard.rows(size).start, start + shard.rows(size).stop)
        for start, size in zip(starts, parts, strict=True)
    ]
    weight = torch.cat([linear.weight[r] for r in rows])  # [sum(parts) / N, in]
    bias = None if linear.bias is None else torch.cat([linear.bias[r] for r in rows])
    _keep_rows(linear, weight, bias)


def _keep_rows(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    # `weight` and `bias` are copies, so the whole tensors they came from are freed
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    linear.out_features = weight.shape[0]


def _row_parallel(linear: nn.Module, shard: TensorShard) -> RowParallelLinear:
    assert isinstance(linear, nn.Linear)
    columns = shard.rows(linear.in_features)
    weight = linear.weight[:, columns].clone()  # [out, in / N]
    bias = None if linear.bias is None or shard.rank != 0 else linear.bias.clone()
    return RowParallelLinear(weight, bias, shard.group)


def _vocab_rows(weight: torch.Tensor, config: ModelConfig, shard: TensorShard) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] table, zero rows padding the last rank's share."""
    per_rank = config.vocab_size_per_rank
    start = shard.rank * per_rank
    rows = weight[start : start + per_rank]  # [<= V / N, hidden]
    missing = per_rank - rows.shape[0]
    if missing == 0:
        return rows.clone()
    padding = torch.zeros((missing, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return torch.cat([rows, padding])
