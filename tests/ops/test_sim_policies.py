"""The policy simulator's steeper cost: attention's growth with context scaled in both the step
times it charges and the table the eviction ranks by."""

from __future__ import annotations

from pathlib import Path

import pytest

from pensieve.actors.cost_model import CostModel
from pensieve.ops.sim_policies import steeper

H200_TABLE = Path(__file__).resolve().parents[2] / "ops/results/cost_h200_llama2-13b-gqa10.json"


def test_a_steeper_profile_multiplies_attentions_growth_only() -> None:
    measured = CostModel.from_json(H200_TABLE)
    assert steeper(measured, 1.0) is measured
    steep = steeper(measured, 8.0)
    floor = measured.attention_s[0]
    assert steep.attention_s[0] == floor and steep.non_attention_s == measured.non_attention_s
    for length in (64, 512, 1000, 4096):
        grown = measured.attention_cost(length) - floor
        assert steep.attention_cost(length) - floor == pytest.approx(8.0 * grown)
    ratio = measured.cost(4096) / measured.cost(32)
    assert 1.1 < ratio < 1.3  # the measured profile is nearly flat
    assert steep.cost(4096) / steep.cost(32) == pytest.approx(2.55, abs=0.01)
