"""The engine's context limit (`context_limit`, --max-model-len): the model's context by default,
cut to what the GPU tier holds; a requested length is taken, or refused if it cannot be served."""

from __future__ import annotations

import logging

import pytest

from pensieve.actors.config import CacheConfig
from pensieve.models import PRESETS
from pensieve.ops.cli import build_parser
from pensieve.ops.cli_engine import engine_options
from pensieve.ops.factory import context_limit

LLAMA31 = PRESETS["llama3.1-8b"]  # 131072 positions
BLOCK = 16


def tier(tokens: int) -> CacheConfig:
    return CacheConfig(block_size=BLOCK, num_gpu_blocks=tokens // BLOCK)


def test_the_default_is_the_models_context_where_the_gpu_tier_holds_it(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pensieve"):
        assert context_limit(None, LLAMA31, tier(200_000)) == 131072
        assert context_limit(None, PRESETS["qwen3-8b"], tier(200_000)) == 32768
    assert not caplog.records


def test_a_context_the_gpu_tier_cannot_hold_is_cut_to_it_and_said(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pensieve"):
        assert context_limit(None, LLAMA31, tier(16384)) == 16384
    (record,) = caplog.records
    assert "131072 tokens" in record.getMessage() and "limited to 16384" in record.getMessage()


def test_a_requested_length_is_taken_if_it_can_be_served() -> None:
    assert context_limit(4096, LLAMA31, tier(16384)) == 4096
    with pytest.raises(ValueError, match="longer than the context of llama3.1-8b"):
        context_limit(131073, LLAMA31, tier(1 << 20))
    with pytest.raises(ValueError, match="does not fit in the GPU tier of 16384 tokens"):
        context_limit(32768, LLAMA31, tier(16384))


def test_max_model_len_is_spelled_as_vllm_users_expect() -> None:
    base = ["serve", "--model", "preset:tiny-llama"]
    parser = build_parser()
    assert engine_options(parser.parse_args(base)).max_model_len is None
    assert (
        engine_options(parser.parse_args([*base, "--max-model-len", "4096"])).max_model_len == 4096
    )
