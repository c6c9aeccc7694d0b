"""CostModel: interpolation, monotonicity, the JSON table and the analytic estimate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pensieve.actors.scheduler.kv.cost_model import PROFILE_FORMAT, CostModel


def table(attention_s: dict[str, float], non_attention_s: float = 10.0) -> dict[str, object]:
    return {
        "format": PROFILE_FORMAT,
        "chunk_size": 32,
        "non_attention_s": non_attention_s,
        "attention_s": attention_s,
        "source": "test",
    }


MODEL = CostModel.from_profile(table({"128": 4.0, "32": 1.0, "64": 2.0}))


@pytest.mark.parametrize(
    ("context_len", "attention"),
    [
        (1, 1.0),  # clamped below the first point
        (32, 1.0),
        (48, 1.5),  # halfway between 32 and 64
        (64, 2.0),
        (96, 3.0),
        (128, 4.0),
        (256, 8.0),  # extrapolated along the last segment (slope 2/64)
    ],
)
def test_piecewise_linear_interpolation(context_len: int, attention: float) -> None:
    assert MODEL.attention_cost(context_len) == pytest.approx(attention)
    assert MODEL.cost(context_len) == pytest.approx(attention + 10.0)


def test_single_point_grows_in_proportion() -> None:
    model = CostModel.from_profile(table({"64": 2.0}, non_attention_s=0.0))
    assert model.cost(32) == 2.0
    assert model.cost(256) == pytest.approx(8.0)


def test_noisy_profile_is_made_monotone() -> None:
    model = CostModel.from_profile(table({"32": 2.0, "64": 1.0, "128": 3.0}))
    assert model.attention_s == (2.0, 2.0, 3.0)
    assert model.cost(48) == model.cost(32)


@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12),
    st.integers(1, 1 << 20),
    st.integers(1, 1 << 20),
)
def test_cost_never_decreases_with_context(seconds: list[float], a: int, b: int) -> None:
    model = CostModel.from_profile(
        table({str(32 << k): s for k, s in enumerate(seconds)}, non_attention_s=0.5)
    )
    low, high = sorted((a, b))
    assert 0.5 <= model.cost(low) <= model.cost(high) + 1e-12


def test_retention_value_is_cost_over_idle_time() -> None:
    assert MODEL.retention_value(64, idle_s=4.0) == pytest.approx(12.0 / 4.0)
    assert MODEL.retention_value(64, idle_s=0.0) == math.inf
    # idler conversations and shorter contexts are worth less
    assert MODEL.retention_value(64, 8.0) < MODEL.retention_value(64, 4.0)
    assert MODEL.retention_value(32, 4.0) < MODEL.retention_value(128, 4.0)


def test_json_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(MODEL.to_json())
    assert CostModel.from_json(path) == MODEL
    assert json.loads(path.read_text())["attention_s"] == {"32": 1.0, "64": 2.0, "128": 4.0}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{}", "not a cost profile"),
        ("not json", "cannot load"),
        (json.dumps(table({})), "one attention time per context length"),
        (json.dumps(table({"32": -1.0})), ">= 0"),
        (json.dumps(table({"0": 1.0})), ">= 1"),
        (json.dumps(table({"32": 1.0}, non_attention_s=-1.0)), "non_attention_s"),
    ],
)
def test_bad_tables_are_rejected(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "cost.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        CostModel.from_json(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError):
        CostModel.from_json(tmp_path / "missing.json")


LLAMA2_13B_GQA = dict(
    num_layers=40,
    hidden_size=5120,
    num_heads=40,
    num_kv_heads=10,
    head_dim=128,
    intermediate_size=13824,
)


def test_analytic_matches_hand_counts() -> None:
    flops, bandwidth = 1e15, 1e12
    model = CostModel.analytic(**LLAMA2_13B_GQA, flops_per_s=flops, bytes_per_s=bandwidth)
    # projections + SwiGLU MLP: 2 FLOPs per weight per token, 32 tokens, 40 layers
    weights_per_layer = 5120 * (40 + 20) * 128 + 40 * 128 * 5120 + 3 * 5120 * 13824
    assert model.non_attention_s == pytest.approx(40 * 2 * 32 * weights_per_layer / flops)
    # at this rate ratio attention is memory bound: K and V of every layer read once, in bf16
    kv_bytes = 40 * 2 * 4096 * 10 * 128 * 2
    assert model.attention_cost(4096) == pytest.approx(kv_bytes / bandwidth)
    assert model.attention_cost(8192) == pytest.approx(2 * model.attention_cost(4096))
    assert model.attention_cost(1 << 20) == pytest.approx(256 * model.attention_cost(4096))


def test_analytic_sanity() -> None:
    model = CostModel.analytic(**LLAMA2_13B_GQA)
    # a 13B model needs about 2 * 13e9 * 32 FLOPs for a chunk: milliseconds at 400 TFLOP/s
    assert 1e-3 < model.cost(32) < 5e-3
    assert model.attention_cost(32) < 0.01 * model.non_attention_s  # short: projections dominate
    assert model.attention_cost(32768) > model.non_attention_s  # long: attention dominates
    mha = CostModel.analytic(**(LLAMA2_13B_GQA | {"num_kv_heads": 40}))
    assert mha.attention_cost(4096) > model.attention_cost(4096)  # more K/V to read
    relu_mlp = CostModel.analytic(**LLAMA2_13B_GQA, gated_mlp=False)
    assert relu_mlp.non_attention_s < model.non_attention_s
