"""The swap engine moves exactly the bytes its orders name, on the real CUDA copy streams."""

from __future__ import annotations

import pytest
import torch

from pensieve.actors.executor.batch_copy import driver_entry_point
from pensieve.actors.executor.swap import MIN_DMA_RUN, SwapEngine
from pensieve.actors.wire.step import CopyOp, SwapOrders

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCKS, SLOTS, SHAPE = 32, 32, (2, 32, 2, 16)


@pytest.fixture
def tiers() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gpu = [torch.randn(BLOCKS, *SHAPE, device="cuda") for _ in range(3)]
    cpu = [torch.randn(SLOTS, *SHAPE).pin_memory() for _ in range(3)]
    return gpu, cpu


def run(engine: SwapEngine, orders: SwapOrders) -> None:
    engine.issue(orders)
    engine.wait_all()
    torch.cuda.synchronize()


@pytest.mark.parametrize("batched", [False, True])  # one driver call per layer, or the others
@pytest.mark.parametrize("out_dma", [False, True])  # swap-outs by the kernel or by DMA only
@pytest.mark.parametrize("contiguous", [False, True])  # copy kernel vs DMA runs
def test_gpu_each_kind_of_order_lands_where_it_says(tiers, contiguous, out_dma, batched):
    gpu, cpu = tiers
    engine = SwapEngine(gpu, cpu, out_dma=out_dma, batched=batched)
    if batched and engine.batch is None:
        # a driver that has the call must pass the copier's start-up probe: otherwise the
        # batched cases would be skipped silently while the other copy paths ran
        assert driver_entry_point() is None, "cuMemcpyBatchAsync is there but its probe failed"
        pytest.skip("the driver has no batched copy (CUDA 12.8+)")
    n = MIN_DMA_RUN + 2
    blocks = list(range(n)) if contiguous else [3, 17, 5, 30, 11, 2, 26, 8, 21, 14][:n]
    slots = list(range(4, 4 + n)) if contiguous else [9, 0, 22, 13, 6, 31, 18, 1, 27, 15][:n]

    before_gpu = [g.clone() for g in gpu]
    run(engine, SwapOrders(swap_out=[CopyOp(b, s) for b, s in zip(blocks, slots, strict=True)]))
    for g, c in zip(before_gpu, cpu, strict=True):
        assert torch.equal(c[slots].cuda(), g[blocks])

    targets = [b + 1 if contiguous else (b + 7) % BLOCKS for b in blocks]
    run(engine, SwapOrders(swap_in=[CopyOp(t, s) for t, s in zip(targets, slots, strict=True)]))
    for g, c in zip(gpu, cpu, strict=True):
        assert torch.equal(g[targets], c[slots].cuda()), "a swap-in alone must copy"

    # one step: save block 29 to slot 3, then load slot 9 into that same block
    saved = [g[29].clone() for g in gpu]
    run(engine, SwapOrders(evict_first=[CopyOp(29, 3)], swap_in=[CopyOp(29, slots[0])]))
    for g, c, old in zip(gpu, cpu, saved, strict=True):
        assert torch.equal(c[3].cuda(), old), "the evict-first copy ran after the swap-in"
        assert torch.equal(g[29], c[slots[0]].cuda())


def test_gpu_stats_without_waiting_count_the_time_of_finished_copies_only(tiers):
    """The stats subject reads swap totals between steps without syncing the copy streams: a
    swap-out stuck behind busy compute is counted in bytes at once and in seconds once done."""
    gpu, cpu = tiers
    engine = SwapEngine(gpu, cpu)
    torch.cuda._sleep(1 << 30)  # compute busy for a while; swap-outs wait for compute issued so far
    engine.issue(SwapOrders(swap_out=[CopyOp(b, b) for b in range(8)]))
    early = engine.collect_stats(wait=False)
    assert early.blocks_out == 8 and early.seconds_out == 0.0, "it waited for the copies"
    torch.cuda.synchronize()
    late = engine.collect_stats(wait=False).seconds_out
    assert late > 0
    assert engine.collect_stats().seconds_out == late  # nothing was left to wait for
