"""Dequantized weights kept on disk (`models/weights_cache.py`): read back exactly as made,
made again when the source changes or the file is damaged, never left half-written."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pensieve.models import weights_cache
from pensieve.models.loader import load_model

SHAPES = {"a.weight": (3, 4), "b.weight": (5,), "c.weight": (2, 2, 2)}


def made(
    log: list[str], seed: int = 0, shapes: dict[str, tuple[int, ...]] = SHAPES
) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        log.append(name)
        yield name, torch.randn(shape, generator=generator)


def files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


def test_tensors_are_made_once_then_read_back_until_the_source_changes(tmp_path: Path) -> None:
    source, folder = tmp_path / "model.gguf", tmp_path / "cache"
    source.write_bytes(b"weights")
    first_log: list[str] = []
    first = dict(weights_cache.cached(source, SHAPES, made(first_log), folder))
    assert first_log == list(SHAPES) and len(files(folder)) == 1
    again_log: list[str] = []
    again = dict(weights_cache.cached(source, SHAPES, made(again_log, seed=1), folder))
    assert again_log == []  # read back: nothing made
    assert list(again) == list(SHAPES)
    assert all(torch.equal(first[name], again[name]) for name in SHAPES)
    os.utime(source, ns=(1, 1))  # the source changed: another key, made again
    changed_log: list[str] = []
    dict(weights_cache.cached(source, SHAPES, made(changed_log, seed=2), folder))
    assert changed_log == list(SHAPES) and len(files(folder)) == 2
    assert dict(weights_cache.cached(source, SHAPES, made([]), None)).keys() == SHAPES.keys()


def test_a_damaged_file_is_made_again_and_a_load_stopped_half_way_leaves_nothing(
    tmp_path: Path,
) -> None:
    source, folder = tmp_path / "model.gguf", tmp_path / "cache"
    source.write_bytes(b"weights")
    stopped = weights_cache.cached(source, SHAPES, made([]), folder)
    next(stopped)
    stopped.close()  # the load failed after the first tensor
    assert files(folder) == []
    dict(weights_cache.cached(source, SHAPES, made([]), folder))
    (cached,) = folder.iterdir()
    cached.write_bytes(cached.read_bytes()[:40])  # truncated
    log: list[str] = []
    remade = dict(weights_cache.cached(source, SHAPES, made(log, seed=3), folder))
    assert log == list(SHAPES)
    read = dict(weights_cache.cached(source, SHAPES, made([]), folder))
    assert all(torch.equal(remade[name], read[name]) for name in SHAPES)
    # a file under the key whose tensors are not those due is not trusted: made again
    other = {"a.weight": (4, 3), "b.weight": (5,), "c.weight": (2, 2, 2)}
    log.clear()
    dict(weights_cache.cached(source, other, made(log, shapes=other), folder))
    assert log == list(other)
    with pytest.raises(ValueError, match="made where"):  # a maker that breaks its word
        dict(weights_cache.cached(source, SHAPES, made([], shapes=other), folder))
    assert [path.suffix for path in folder.iterdir()] == [".safetensors"]


@pytest.mark.slow
def test_smollm2_loads_the_same_weights_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(weights_cache.ENV, str(tmp_path))
    written = load_model("smollm2", "cpu", torch.float32).model.state_dict()
    assert len(files(tmp_path)) == 1
    read = load_model("smollm2", "cpu", torch.float32).model.state_dict()
    monkeypatch.delenv(weights_cache.ENV)
    fresh = load_model("smollm2", "cpu", torch.float32).model.state_dict()
    for name, tensor in fresh.items():
        assert torch.equal(tensor, written[name]) and torch.equal(tensor, read[name]), name
