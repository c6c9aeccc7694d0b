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


def test_the_batched_copier_names_the_bytes_of_each_block_run(monkeypatch):
    """`BatchCopier.copy` hands the driver one (destination, source, size) triple per run and
    layer; here a stand-in for the driver call performs them with memmove on ordinary memory, so
    the address arithmetic is checked without a GPU."""
    import ctypes
    from types import SimpleNamespace

    import numpy as np

    from pensieve.actors.batch_copy import BatchCopier

    calls: list[int] = []  # copies per driver call

    def driver(dsts, srcs, sizes, count, attrs, first, num_attrs, stream):
        calls.append(count)

        def read(address: int) -> np.ndarray:  # `count` uint64 values at an address
            return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint64)),
                                         (count,))  # fmt: skip

        for d, s, n in zip(read(dsts), read(srcs), read(sizes), strict=True):
            ctypes.memmove(int(d), int(s), int(n))
        return 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=7))
    gpu = [torch.randn(12, 2, 4, 2, 8) for _ in range(3)]
    cpu = [torch.zeros(10, 2, 4, 2, 8) for _ in range(3)]
    copier = BatchCopier(driver, False, gpu, cpu)
    runs = [(0, 5, 2), (7, 0, 1), (9, 2, 3)]  # (gpu start, cpu start, blocks)
    copier.copy([0, 2], runs, to_gpu=False)
    for layer in (0, 2):
        for g, c, n in runs:
            assert torch.equal(cpu[layer][c : c + n], gpu[layer][g : g + n])
    assert not cpu[1].any(), "a layer not asked for was copied"
    # many layers go in calls of 1, 2, 4, ... layers, so the copy engines start after the first
    calls.clear()
    copier.copy([2, 1, 0], runs, to_gpu=False)
    assert calls == [len(runs), 2 * len(runs)]
    for layer in range(3):
        for g, c, n in runs:
            assert torch.equal(cpu[layer][c : c + n], gpu[layer][g : g + n])
    many = [torch.randn(2, 2, 4, 2, 8) for _ in range(40)]
    slots = [torch.zeros_like(t) for t in many]  # the copier keeps addresses only
    calls.clear()
    BatchCopier(driver, False, many, slots).copy(range(40), [(0, 1, 1)], to_gpu=False)
    assert calls == [1, 2, 4, 8, 16, 9]
    assert all(torch.equal(c[1], g[0]) for g, c in zip(many, slots, strict=True))
    for layer in range(3):
        gpu[layer].zero_()
    copier.copy([1], [(3, 5, 2)], to_gpu=True)
    assert torch.equal(gpu[1][3:5], cpu[1][5:7]) and not gpu[0].any()
    prepared = copier.prepare(runs)  # once per step, then one call per layer (pipelined swap-in)
    for layer in (2, 0):
        copier.copy([layer], prepared, to_gpu=True)
        for g, c, n in runs:
            assert torch.equal(gpu[layer][g : g + n], cpu[layer][c : c + n])
    assert not gpu[1][:3].any() and not gpu[1][5:].any(), "layer 1 got more than its own run"
