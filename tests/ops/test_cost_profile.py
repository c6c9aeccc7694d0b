"""`pensieve profile` on a tiny random-weight model on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pensieve.actors.scheduler.kv.cost_model import CostModel
from pensieve.models.loader import load_model
from pensieve.ops.cost_profile import ProfileSettings, main, profile_model

TINY = "preset:tiny-llama"


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    # Timings of tiny ops are dominated by thread hand-offs on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_profile_table_loads_and_grows_with_context() -> None:
    loaded = load_model(TINY, "cpu", torch.float32)
    settings = ProfileSettings(max_context=2048, batch_chunks=2, warmup=1, repeats=5)
    table = profile_model(loaded.model, loaded.config, "cpu", torch.float32, settings)
    assert list(table["attention_s"]) == ["32", "64", "128", "256", "512", "1024", "2048"]
    raw = table["attention_s"]
    assert raw["2048"] > raw["32"] > 0
    assert table["non_attention_s"] > 0
    model = CostModel.from_profile(table)
    costs = [model.cost(n) for n in range(32, 4097, 32)]
    assert costs == sorted(costs)
    assert model.cost(4096) > model.cost(32)
    assert "tiny-llama" in model.source and "cpu" in model.source


def test_chunk_size_that_is_not_a_power_of_two() -> None:
    loaded = load_model(TINY, "cpu", torch.float32)
    settings = ProfileSettings(chunk_size=48, max_context=256, batch_chunks=1, repeats=1)
    table = profile_model(loaded.model, loaded.config, "cpu", torch.float32, settings)
    assert list(table["attention_s"]) == ["64", "128", "256"]
    assert CostModel.from_profile(table).chunk_size == 48


def test_main_writes_what_cost_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiles" / "tiny.json"
    argv = ["--model", TINY, "--out", str(out), "--device", "cpu", "--max-context", "256"]
    assert main([*argv, "--batch-chunks", "2", "--warmup", "0", "--repeats", "2"]) == 0
    model = CostModel.from_json(out)
    assert model.context_lens == (32, 64, 128, 256)
    assert model.chunk_size == 32
    printed = capsys.readouterr().out
    assert "context" in printed and f"wrote {out}" in printed


def test_attention_batches_shrink_to_the_kv_budget() -> None:
    settings = ProfileSettings(batch_chunks=16, max_kv_tokens=4096)
    assert [settings.chunks_at(n) for n in (32, 256, 512, 4096, 16384)] == [16, 16, 8, 1, 1]
    with pytest.raises(ValueError):
        ProfileSettings(batch_chunks=0)


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        main(["--model", "preset:nope", "--out", str(tmp_path / "x.json"), "--device", "cpu"])
