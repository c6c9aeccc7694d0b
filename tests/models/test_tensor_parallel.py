"""Tensor parallelism: a model split over ranks gives the logits and tokens of the whole model.

Two CPU processes over gloo run the tiny models through the ModelRunner (the reference attention
path), against the same run on one rank; the GPU test does the same over NCCL on two GPUs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from tensor_parallel_ranks import CASES, one_rank, run_ranks

from pensieve.actors.config import ALL_REDUCE_ENV, ExecutorConfig
from pensieve.models import PRESETS, build_model, load_model
from pensieve.models.shard_loader import load_shard
from pensieve.models.tensor_parallel import (
    RowParallelLinear,
    TensorShard,
    VocabParallelEmbedding,
    prepare_all_reduce,
    reducer,
    shard_model,
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_ranks(2, "gloo", tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_logits_and_tokens_of_one(
    two_ranks: dict[str, list[dict[str, Any]]], case: str
) -> None:
    whole = one_rank(case, torch.device("cpu"))
    for rank in two_ranks[case]:
        torch.testing.assert_close(rank["logits"], whole["logits"], atol=1e-5, rtol=0)
        assert rank["tokens"] == whole["tokens"]
    # an unseeded draw is rank 0's on every rank, so both write the KV of the same tokens
    assert two_ranks[case][0]["drawn"] == two_ranks[case][1]["drawn"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("all_reduce", ["nccl", "peer"])
def test_gpu_two_ranks_give_the_logits_and_tokens_of_one(tmp_path: Path, all_reduce: str) -> None:
    """Over NCCL, with the Triton kernels and the CUDA graphs of the decode steps; the sums of
    the row-parallel layers through NCCL, or through symmetric memory (which must not fall
    back)."""
    ranks = run_ranks(2, "nccl", tmp_path, all_reduce)
    for case in CASES:
        whole = one_rank(case, torch.device("cuda:0"))
        for rank in ranks[case]:
            assert rank["all_reduce"] == all_reduce, case
            torch.testing.assert_close(rank["logits"], whole["logits"], atol=1e-5, rtol=0)
            assert rank["tokens"] == whole["tokens"], case
        assert ranks[case][0]["drawn"] == ranks[case][1]["drawn"], case


def test_the_all_reduce_mode_is_checked_and_peer_sums_stay_on_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ALL_REDUCE_ENV, "ring")
    with pytest.raises(ValueError, match="PENSIEVE_ALL_REDUCE='ring': one of nccl, peer"):
        ExecutorConfig.from_environment()
    with pytest.raises(ValueError, match="all-reduce mode 'ring': one of nccl, peer"):
        prepare_all_reduce(TensorShard(0, 2), torch.device("cpu"), "ring")
    # on CPUs the group's own all-reduce (gloo) sums, whatever is asked: no collective here
    monkeypatch.setenv(ALL_REDUCE_ENV, "peer")
    mode = ExecutorConfig.from_environment().all_reduce.value
    assert prepare_all_reduce(TensorShard(0, 2), torch.device("cpu"), mode) == "gloo"
    assert reducer(None).buffer is None


def test_shards_hold_their_heads_and_vocabulary_rows() -> None:
    """On the meta device: shapes only, as a checkpoint too big for one GPU is split."""
    config = PRESETS["llama2-13b-gqa10"]
    model = shard_model(build_model(config, "meta", torch.bfloat16), TensorShard(1, 2))
    attention = model.layers[0].attention
    assert attention.num_heads == 20 and attention.num_kv_heads == 5
    assert attention.qkv_proj.weight.shape == ((20 + 2 * 5) * 128, 5120)
    assert isinstance(attention.o_proj, RowParallelLinear)
    assert attention.o_proj.weight.shape == (5120, 20 * 128)
    assert attention.o_proj.bias is None
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (13824, 5120)
    assert isinstance(model.embed_tokens, VocabParallelEmbedding)
    assert model.embed_tokens.start == 16000
    assert model.lm_head is not None and model.lm_head.weight.shape == (16000, 5120)
    assert model.config.tensor_parallel_size == 2
    assert model.config.kv_cache_shape(10, 32) == (10, 2, 32, 5, 128)
    assert model.config.kv_bytes_per_token(torch.bfloat16) == 2 * 40 * 5 * 128 * 2


def test_row_parallel_bias_is_added_once() -> None:
    config = dataclasses.replace(PRESETS["tiny-opt"], vocab_size=511)
    first = shard_model(build_model(config, "meta", torch.float32), TensorShard(0, 2))
    second = shard_model(build_model(config, "meta", torch.float32), TensorShard(1, 2))
    assert first.layers[0].fc2.bias is not None and second.layers[0].fc2.bias is None
    assert first.embed_tokens.weight.shape[0] == second.embed_tokens.weight.shape[0] == 256


@pytest.mark.parametrize(
    ("name", "ranks", "what"),
    [
        ("tiny-qwen3", 2, "1 KV heads"),
        ("llama2-13b-gqa10", 4, "10 KV heads"),
        ("tiny-llama", 8, "2 KV heads"),
    ],
)
def test_heads_that_do_not_divide_are_a_clear_error(name: str, ranks: int, what: str) -> None:
    model = build_model(PRESETS[name], "meta", torch.float32)
    with pytest.raises(ValueError, match=f"{what} do not divide over {ranks} tensor-parallel"):
        shard_model(model, TensorShard(0, ranks))


def test_a_split_model_is_not_split_again() -> None:
    model = shard_model(
        build_model(PRESETS["tiny-llama"], "meta", torch.float32), TensorShard(0, 2)
    )
    with pytest.raises(ValueError, match="split over ranks already"):
        shard_model(model, TensorShard(0, 2))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_a_preset_loaded_by_rank_has_the_weights_of_the_whole_one_split(name: str) -> None:
    for rank in range(2):
        shard = TensorShard(rank, 2)
        direct = load_shard(f"preset:{name}", "cpu", torch.float32, shard, seed=5).model
        whole = load_model(f"preset:{name}", "cpu", torch.float32, seed=5).model
        split = dict(shard_model(whole, shard).named_parameters())
        params = dict(direct.named_parameters())
        assert params.keys() == split.keys()
        for key, param in params.items():
            assert torch.equal(param, split[key]), key


def _checkpoint(kind: str, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

    common = dict(
        vocab_size=301,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    if kind == "llama":  # GQA, a bias on every linear layer, an odd vocabulary, its own head
        config: Any = LlamaConfig(
            **common,
            intermediate_size=112,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
        )
    else:
        config = OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():  # biases too (transformers zeroes them)
            param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(param.numel()))
    model.save_pretrained(folder / kind)
    return folder / kind


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_a_checkpoint_read_by_rank_gives_the_whole_one_split(kind: str, tmp_path: Path) -> None:
    """Each rank reads its rows or columns of each checkpoint tensor: the weights of the whole
    model loaded, then split."""
    folder = _checkpoint(kind, tmp_path)
    for rank in range(2):
        shard = TensorShard(rank, 2)
        direct = dict(load_shard(str(folder), "cpu", torch.float32, shard).model.named_parameters())
        whole = load_model(str(folder), "cpu", torch.float32).model
        split = dict(shard_model(whole, shard).named_parameters())
        assert direct.keys() == split.keys()
        for key, param in direct.items():
            assert torch.equal(param, split[key]), key
