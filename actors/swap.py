"""The swap manager's copy engine: moves KV blocks between the GPU tier and the CPU tier.

On CUDA, copies run on two dedicated streams (one per direction) and overlap compute:

    out-stream:  [evict_first] ---------------------------(wait last swap-in)--[swap_out ...]
    in-stream:        (wait evict_first)--[layer 0][layer 1] ... [layer L-1]
    compute:                              (wait L0) attn 0 (wait L1) attn 1 ...

Swap-in has priority: no GPU->CPU copy of the step starts before its CPU->GPU copies are done.
On a machine without a GPU both tiers are ordinary memory and the same copies run in order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pensieve.actors.kv_cache import CopyOp, SwapOrders
from pensieve.kernels.block_copy import copy_blocks


@dataclass
class SwapStats:
    blocks_in: int = 0
    blocks_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0


MIN_DMA_RUN = 8  # mean run length (blocks) from which plain DMA copies beat the copy kernel
# grid caps of the copy kernel (see kernels/block_copy.py): a swap-out runs beside compute and is
# not waited for, so it takes few SMs; a swap-in gates each layer's attention, so it takes more
OUT_PROGRAMS = 8
IN_PROGRAMS = 32


def copy_runs(ops: list[CopyOp]) -> list[tuple[int, int, int]]:
    """Group copies into (gpu_start, cpu_start, length) runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for op in sorted(ops, key=lambda o: o.cpu_slot):
        if runs:
            g, c, n = runs[-1]
            if op.gpu_block == g + n and op.cpu_slot == c + n:
                runs[-1] = (g, c, n + 1)
                continue
        runs.append((op.gpu_block, op.cpu_slot, 1))
    return runs


class SwapEngine:
    def __init__(self, gpu_caches: list[torch.Tensor], cpu_caches: list[torch.Tensor]) -> None:
        self.gpu_caches = gpu_caches  # per layer [num_gpu_blocks, 2, bs, Hkv, D]
        self.cpu_caches = cpu_caches  # per layer [num_cpu_blocks, 2, bs, Hkv, D], pinned on CUDA
        self.cuda = bool(gpu_caches) and gpu_caches[0].is_cuda
        self.block_bytes = gpu_caches[0][0].numel() * gpu_caches[0].element_size() * len(gpu_caches)
        self.stats = SwapStats()
        self._layer_events: list[torch.cuda.Event] | None = None
        self._fence: torch.cuda.Event | None = None
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.zero_copy = False
        if self.cuda:
            self.in_stream = torch.cuda.Stream()
            self.out_stream = torch.cuda.Stream()
            self.zero_copy = (
                bool(cpu_caches)
                and cpu_caches[0].shape[0] > 1
                and _zero_copy_works(gpu_caches[0], cpu_caches[0])
            )

    def issue(self, orders: SwapOrders) -> None:
        """Start the step's copies; `wait_layer` / `wait_fence` order compute after them."""
        self._layer_events = None
        self._fence = None
        if orders.is_empty() and not orders.fence:
            return
        if not self.cuda:
            self._copy_out(orders.evict_first)
            self._copy_in_all_layers(orders.swap_in)
            self._copy_out(orders.swap_out)
            return
        compute = torch.cuda.current_stream()
        self.out_stream.wait_stream(compute)
        with torch.cuda.stream(self.out_stream):
            self._timed("out", self._copy_out, orders.evict_first)
            self._fence = torch.cuda.Event()
            self._fence.record()
        if orders.swap_in:
            self.in_stream.wait_event(self._fence)
            self.in_stream.wait_stream(compute)
            with torch.cuda.stream(self.in_stream):
                self._layer_events = self._timed("in", self._copy_in_by_layer, orders.swap_in)
        if orders.swap_out:
            if self._layer_events:
                self.out_stream.wait_event(self._layer_events[-1])
            with torch.cuda.stream(self.out_stream):
                self._timed("out", self._copy_out, orders.swap_out)
        if orders.evict_first or orders.fence:
            compute.wait_event(self._fence)

    def wait_layer(self, layer: int) -> None:
        """Compute waits for layer `layer`'s swap-in copies only (pipelined swap-in)."""
        if self._layer_events is not None:
            torch.cuda.current_stream().wait_event(self._layer_events[layer])

    @property
    def pipelined(self) -> bool:
        return self._layer_events is not None

    def collect_stats(self) -> SwapStats:
        """Fold finished CUDA timings into `stats` (synchronizes the copy streams)."""
        for direction, start, end in self._timings:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
            if direction == "in":
                self.stats.seconds_in += seconds
            else:
                self.stats.seconds_out += seconds
        self._timings.clear()
        return self.stats

    # ---- copies --------------------------------------------------------------------------

    def _timed(self, direction: str, fn, ops):  # type: ignore[no-untyped-def]
        if not ops:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(ops)
        end.record()
        self._timings.append((direction, start, end))
        return result

    def _copy_out(self, ops: list[CopyOp]) -> None:
        if not ops:
            return
        begin = time.perf_counter()
        runs = copy_runs(ops)
        if self._use_kernel(ops, runs):
            gpu_ids, cpu_ids = self._indices(ops)
            for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
                copy_blocks(gpu, cpu, gpu_ids, cpu_ids, OUT_PROGRAMS)
        else:
            for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
                for g, c, n in runs:
                    cpu[c : c + n].copy_(gpu[g : g + n], non_blocking=self.cuda)
        self.stats.blocks_out += len(ops)
        self.stats.bytes_out += len(ops) * self.block_bytes
        if not self.cuda:
            self.stats.seconds_out += time.perf_counter() - begin

    def _copy_in_by_layer(self, ops: list[CopyOp]) -> list[torch.cuda.Event]:
        runs = copy_runs(ops)
        kernel = self._use_kernel(ops, runs)
        gpu_ids, cpu_ids = self._indices(ops) if kernel else (None, None)
        events = []
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
            if kernel:
                copy_blocks(cpu, gpu, cpu_ids, gpu_ids, IN_PROGRAMS)
            else:
                for g, c, n in runs:
                    gpu[g : g + n].copy_(cpu[c : c + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            events.append(event)
        self.stats.blocks_in += len(ops)
        self.stats.bytes_in += len(ops) * self.block_bytes
        return events

    def _use_kernel(self, ops: list[CopyOp], runs: list[tuple[int, int, int]]) -> bool:
        return self.zero_copy and len(ops) < MIN_DMA_RUN * len(runs)

    def _indices(self, ops: list[CopyOp]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = torch.tensor([(op.gpu_block, op.cpu_slot) for op in ops], dtype=torch.int32)
        pairs = pairs.pin_memory().to(self.gpu_caches[0].device, non_blocking=True)
        return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()

    def _copy_in_all_layers(self, ops: list[CopyOp]) -> None:
        if not ops:
            return
        begin = time.perf_counter()
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
            for g, c, n in copy_runs(ops):
                gpu[g : g + n].copy_(cpu[c : c + n])
        self.stats.blocks_in += len(ops)
        self.stats.bytes_in += len(ops) * self.block_bytes
        self.stats.seconds_in += time.perf_counter() - begin


def _zero_copy_works(gpu: torch.Tensor, cpu: torch.Tensor) -> bool:
    """Check once that the copy kernel can reach pinned host memory; else use DMA copies only."""
    try:
        probe = torch.randn(gpu[:2].shape, device=gpu.device).to(gpu.dtype)
        saved_gpu, saved_cpu = gpu[:2].clone(), cpu[:2].clone()
        gpu[:2] = probe
        ids = torch.tensor([0, 1], dtype=torch.int32, device=gpu.device)
        swapped = torch.tensor([1, 0], dtype=torch.int32, device=gpu.device)
        copy_blocks(gpu, cpu, ids, swapped)
        torch.cuda.synchronize()
        ok = torch.equal(cpu[1].to(gpu.device), probe[0]) and torch.equal(
            cpu[0].to(gpu.device), probe[1]
        )
        gpu[:2], cpu[:2] = saved_gpu, saved_cpu
        return ok
    except Exception:  # noqa: BLE001 - any failure means: no zero-copy on this platform
        return False
