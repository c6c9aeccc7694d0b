"""The swap engine's copy-engine path, on ordinary memory (on CUDA it issues the same copies)."""

from __future__ import annotations

import pytest
import torch

from pensieve.actors.executor.swap import SwapEngine, copy_runs
from pensieve.actors.wire.step import CopyOp


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
    """The batched copier hands the driver one (destination, source, size) triple per run and
    layer; here a stand-in for the driver call performs them with memmove on ordinary memory, so
    the address arithmetic is checked without a GPU."""
    import ctypes

    import numpy as np

    from pensieve.actors.executor.batch_copy import BatchCopier

    calls: list[tuple[int, int]] = []  # (copies, stream) of each driver call

    def driver(dsts, srcs, sizes, count, attrs, first, num_attrs, stream):
        calls.append((count, stream))

        def read(address: int) -> np.ndarray:  # `count` uint64 values at an address
            return np.ctypeslib.as_array(
                ctypes.cast(address, ctypes.POINTER(ctypes.c_uint64)), (count,)
            )

        for d, s, n in zip(read(dsts), read(srcs), read(sizes), strict=True):
            ctypes.memmove(int(d), int(s), int(n))
        return 0

    gpu = [torch.randn(12, 2, 4, 2, 8) for _ in range(3)]
    cpu = [torch.zeros(10, 2, 4, 2, 8) for _ in range(3)]
    copier = BatchCopier(driver, False, gpu, cpu)
    runs = [(0, 5, 2), (7, 0, 1), (9, 2, 3)]  # (gpu start, cpu start, blocks)
    out = copier.plan(runs, to_gpu=False)
    out.issue(range(1, 3), stream=7)  # layers 1 and 2: one call of one layer, one of the next
    assert calls == [(len(runs), 7), (len(runs), 7)]
    for layer in (1, 2):
        for g, c, n in runs:
            assert torch.equal(cpu[layer][c : c + n], gpu[layer][g : g + n])
    assert not cpu[0].any(), "a layer not asked for was copied"
    for layer in range(3):
        gpu[layer].zero_()
    back = copier.plan(runs, to_gpu=True)  # made once, then one call per layer (pipelined)
    for layer in (2, 1):
        back.issue_range(range(layer, layer + 1), stream=9)
        for g, c, n in runs:
            assert torch.equal(gpu[layer][g : g + n], cpu[layer][c : c + n])
    assert not gpu[0].any(), "layer 0 was copied"
    gpu[1].zero_()
    copier.plan([(3, 5, 2)], to_gpu=True).issue_range(range(1, 2), stream=9)
    assert torch.equal(gpu[1][3:5], cpu[1][5:7]) and not gpu[1][:3].any()
    assert not gpu[1][5:].any(), "layer 1 got more than its own run"
    # many layers go in calls of 1, 2, 4, ... layers, so the copy engines start after the first
    many = [torch.randn(2, 2, 4, 2, 8) for _ in range(40)]
    slots = [torch.zeros_like(t) for t in many]  # the copier keeps addresses only
    calls.clear()
    BatchCopier(driver, False, many, slots).plan([(0, 1, 1)], False).issue(range(40), 3)
    assert [count for count, _ in calls] == [1, 2, 4, 8, 16, 9]
    assert all(torch.equal(c[1], g[0]) for g, c in zip(many, slots, strict=True))
    calls.clear()
    copier.plan(runs, to_gpu=False).issue_range(range(3), stream=5)  # a group: one call
    assert calls == [(3 * len(runs), 5)]
    with pytest.raises(ValueError, match="consecutive"):
        out.issue(range(0, 3, 2), stream=7)


def test_a_pipelined_swap_in_groups_layers_after_the_first() -> None:
    """Layer 0 alone (the step waits for it first), then 1, 2 and fours: every layer once, in
    order, so each layer's attention waits on the event of the group holding its copies."""
    from pensieve.actors.executor.swap import GROUP_LAYERS, layer_groups

    for num_layers in (1, 2, 3, 4, 5, 12, 40):
        groups = layer_groups(num_layers)
        assert [layer for g in groups for layer in g] == list(range(num_layers))
        assert all(len(g) <= GROUP_LAYERS for g in groups)
        assert len(groups[0]) == 1
    assert [len(g) for g in layer_groups(40)] == [1, 1, 2] + [4] * 9
