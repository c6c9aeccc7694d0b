"""The swap engine's copy-engine path, on ordinary memory (on CUDA it issues the same copies)."""

from __future__ import annotations

import torch

from pensieve.actors.kv_cache import CopyOp
from pensieve.actors.swap import SwapEngine, copy_runs


def test_copy_engine_copies_move_each_run_in_every_layer() -> None:
    gpu = [torch.randn(12, 2, 4, 2, 8) for _ in range(3)]
    cpu = [torch.randn(10, 2, 4, 2, 8) for _ in range(3)]
    engine = SwapEngine(gpu, cpu)
    out = [CopyOp(7, 1), CopyOp(2, 5), CopyOp(3, 6), CopyOp(4, 7), CopyOp(11, 0)]
    runs = copy_runs(out)
    assert sorted(n for _, _, n in runs) == [1, 1, 3]  # single blocks and one run of three
    saved = [g.clone() for g in gpu]
    engine._dma(range(3), runs, to_gpu=False)
    for g, c in zip(saved, cpu, strict=True):
        for op in out:
            assert torch.equal(c[op.cpu_slot], g[op.gpu_block])
    back = [CopyOp(9, 1), CopyOp(0, 5), CopyOp(1, 6)]
    engine._dma((1,), copy_runs(back), to_gpu=True)  # one layer only
    for layer, (g, c) in enumerate(zip(gpu, cpu, strict=True)):
        for op in back:
            moved = torch.equal(g[op.gpu_block], c[op.cpu_slot])
            assert moved == (layer == 1)
