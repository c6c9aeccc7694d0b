"""The swap manager's copy engine: moves KV blocks between the GPU tier and the CPU tier.

On CUDA, copies run on two dedicated streams and overlap compute:

    in-stream:   (wait earlier out copies)--[L0][L1][L2-3][L4-7] ... [L36-39]
    out-stream:  ---------------------------------------(wait last group)--[swap_out ...]
    compute:                  (wait L0) layer 0 (wait L1) layer 1 (wait L2-3) layers 2, 3 ...

The step's evict-first copies (blocks it reuses at once) and its swap-ins both go layer group by
layer group on one stream (evict, then load, in each): layer i computes as soon as its group's
blocks are saved and loaded, so neither stalls the whole step up front. Swap-in has priority
over ahead-of-time swap-out: no swap-out of the step starts before its CPU->GPU copies are done.
On a machine without a GPU both tiers are ordinary memory and the same copies run in order.

When each kind of copy of the latest step ran is in `windows` (see `swap_tracing.py`): on CUDA
the timing events around the copies on their stream (the evict-first copies and the swap-ins of
a step share one window, as they are issued between each other's layers), on the host the host
clock around them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pensieve.actors.executor.batch_copy import BatchCopier, LayerCopies
from pensieve.actors.wire.step import CopyKind, CopyOp, SwapOrders, SwapStats
from pensieve.kernels.block_copy import copy_blocks

MIN_DMA_RUN = 8  # mean run length (blocks) from which plain DMA copies beat the copy kernel
# grid caps of the copy kernel (see kernels/block_copy.py): an ahead-of-time swap-out runs beside
# compute and nothing waits for it, so it takes few SMs; a swap-in gates each layer's attention,
# so it takes more; an evict-first copy gates the whole step, so it takes the whole GPU
OUT_PROGRAMS = 16
IN_PROGRAMS = 32
HIGHEST_PRIORITY = -64  # CUDA maps it to the device's highest stream priority
GROUP_LAYERS = 4  # layers per driver call of a pipelined swap-in, after the first few


@dataclass(frozen=True)
class CopyWindow:
    """When some copies of a step ran: the host clock around copies the host made itself (ns
    since the epoch), or the timing events recorded around them on their copy stream."""

    start_ns: int = 0
    end_ns: int = 0
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def done(self) -> bool:
        """Whether the copies are done (asks the device, never waits)."""
        return self.events is None or self.events[1].query()


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


def layer_groups(num_layers: int) -> list[range]:
    """The layers of a pipelined swap-in, in groups issued as one driver call with one event:
    1, 1, 2, then 4 at a time. Layer 0's copies stay alone, as the step waits for them before
    anything else; grouping the rest cuts a 40-layer model's 40 calls, events and waits to 12.
    With the addresses made once per step too, this cuts the host's time to issue and wait for a
    swap-in about threefold, which matters as a step with swap-ins waits between its layers. A
    group's first layer waits for three more layers' copies: where copies are slower
    than compute, up to three layers of compute at the end are not overlapped."""
    groups, begin = [], 0
    for size in (1, 1, 2):
        if begin < num_layers:
            groups.append(range(begin, min(begin + size, num_layers)))
            begin += size
    groups += [
        range(b, min(b + GROUP_LAYERS, num_layers)) for b in range(begin, num_layers, GROUP_LAYERS)
    ]
    return groups


class SwapEngine:
    def __init__(
        self,
        gpu_caches: list[torch.Tensor],
        cpu_caches: list[torch.Tensor],
        out_dma: bool = True,
        batched: bool = True,
    ) -> None:
        """`out_dma`: ahead-of-time swap-outs always by DMA (the copy engines) rather than the copy
        kernel, which holds SMs while it waits on PCIe. DMA is slower for scattered blocks and
        costs the host a copy call per block and layer, but it leaves every SM to the step it
        runs beside, and the engine issues those calls while the step before runs, so their host
        cost is hidden: with that overlap this is the faster choice.

        `batched`: where the driver has it, every copy goes to the copy engines in batched
        calls, one per group of layers (swap-in, evict-first; `layer_groups`) or a few per step
        (swap-out, layers in calls of 1, 2, 4, ...): that reaches the PCIe rate without holding
        an SM and costs the host little (~0.7 ms for a 2k-token swap-in's 12 calls with their
        events and waits), so it replaces both the copy kernel and the per-block DMA calls."""
        self.out_dma = out_dma
        self.gpu_caches = gpu_caches  # per layer [num_gpu_blocks, 2, bs, Hkv, D]
        self.cpu_caches = cpu_caches  # per layer [num_cpu_blocks, 2, bs, Hkv, D], pinned on CUDA
        self.cuda = bool(gpu_caches) and gpu_caches[0].is_cuda
        self.block_bytes = gpu_caches[0][0].numel() * gpu_caches[0].element_size() * len(gpu_caches)
        self.stats = SwapStats()
        self._layer_events: list[torch.cuda.Event] | None = None
        self._waited: torch.cuda.Event | None = None  # the last layer event compute waited on
        # swap-outs held back by `issue(defer_out=True)`: (copies, compute mark, last swap-in)
        self._deferred: tuple[list[CopyOp], torch.cuda.Event, torch.cuda.Event | None] | None
        self._deferred = None
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.windows: dict[CopyKind, CopyWindow] = {}  # of the step issued last, by kind
        self.zero_copy = False
        self._views: tuple[list[tuple[torch.Tensor, ...]], list[tuple[torch.Tensor, ...]]] | None
        self._views = None
        if self.cuda:
            # swap-ins gate attention layer by layer: their copy kernel's programs go first when
            # SMs free up, rather than queue behind the step's matrix products while each layer
            # waits for its copies; ahead-of-time swap-outs, which nothing waits for, stay at
            # the default, lowest priority, like compute
            self.in_stream = torch.cuda.Stream(priority=HIGHEST_PRIORITY)
            self.out_stream = torch.cuda.Stream()
            self.zero_copy = (
                bool(cpu_caches)
                and cpu_caches[0].shape[0] > 1
                and _zero_copy_works(gpu_caches[0], cpu_caches[0])
            )
        self.batch = BatchCopier.create(gpu_caches, cpu_caches) if self.cuda and batched else None

    def issue(self, orders: SwapOrders, defer_out: bool = False) -> None:
        """Start the step's copies; `wait_layer` / `wait_all` order compute after them.

        `defer_out`: hold the ahead-of-time swap-outs until `issue_out`. The runner issues them
        after the step's forward: their copies still start as soon as the step's swap-ins are
        done (they wait for nothing the forward does, as it never writes a block being swapped
        out), and the host's ~40 copy launches do not delay the forward's start."""
        self._layer_events = None
        self._waited = None
        self._deferred = None
        self.windows = {}
        if orders.is_empty() and not orders.fence:
            return
        if not self.cuda:
            self._host_timed(CopyKind.EVICT_FIRST, self._copy_out, orders.evict_first, None)
            self._host_timed(CopyKind.SWAP_IN, self._copy_in_all_layers, orders.swap_in)
            self._host_timed(CopyKind.SWAP_OUT, self._copy_out, orders.swap_out, None)
            return
        compute = torch.cuda.current_stream()
        if orders.evict_first or orders.swap_in:
            # after every GPU->CPU copy issued earlier: a block or slot reused now may still be
            # the source or target of one (the `fence` case)
            self.in_stream.wait_stream(compute)
            self.in_stream.wait_stream(self.out_stream)
            with torch.cuda.stream(self.in_stream):
                direction = "in" if orders.swap_in else "out"
                kinds = [CopyKind.EVICT_FIRST] if orders.evict_first else []
                kinds += [CopyKind.SWAP_IN] if orders.swap_in else []
                self._layer_events = self._timed(
                    direction, kinds, self._copy_by_layer, orders.evict_first, orders.swap_in
                )
        elif orders.fence:
            compute.wait_stream(self.out_stream)
        if orders.swap_out:
            before = torch.cuda.Event()  # the copies wait for compute issued so far, only
            before.record(compute)
            after = self._layer_events[-1] if self._layer_events else None
            self._deferred = (orders.swap_out, before, after)
            if not defer_out:
                self.issue_out()

    def issue_out(self) -> None:
        """Issue the ahead-of-time swap-outs `issue(..., defer_out=True)` held back, if any."""
        if self._deferred is None:
            return
        ops, before, after = self._deferred
        self._deferred = None
        self.out_stream.wait_event(before)
        if after is not None:
            self.out_stream.wait_event(after)
        with torch.cuda.stream(self.out_stream):
            self._timed("out", [CopyKind.SWAP_OUT], self._copy_out, ops, OUT_PROGRAMS, self.out_dma)

    def settle(self) -> None:
        """Wait for every copy issued so far and forget the step's layer events (after a step
        that failed: its copies may still be running)."""
        self._layer_events = None
        self._deferred = None
        if self.cuda:
            torch.cuda.synchronize(self.gpu_caches[0].device)

    @property
    def copy_streams(self) -> tuple[torch.cuda.Stream, ...]:
        """The streams of the copies (on CUDA; none elsewhere, where copies run in order)."""
        return (self.in_stream, self.out_stream) if self.cuda else ()

    def wait_layer(self, layer: int) -> None:
        """Compute waits for layer `layer`'s copies only (pipelined swap-in); the layers of one
        group share an event, waited on once."""
        if self._layer_events is not None:
            event = self._layer_events[layer]
            if event is not self._waited:
                torch.cuda.current_stream().wait_event(event)
                self._waited = event

    def wait_all(self) -> None:
        """Compute waits for every layer's copies (a captured graph cannot wait per layer)."""
        if self._layer_events:
            torch.cuda.current_stream().wait_event(self._layer_events[-1])

    @property
    def pipelined(self) -> bool:
        return self._layer_events is not None

    def collect_stats(self, wait: bool = True) -> SwapStats:
        """Fold the CUDA timings of finished copies into `stats`: with `wait`, of every copy
        issued (synchronizes the copy streams); without, of those already done (copies still
        running count their bytes now and their time at a later call)."""
        pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        for direction, start, end in self._timings:
            if not wait and not end.query():
                pending.append((direction, start, end))
                continue
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
            if direction == "in":
                self.stats.seconds_in += seconds
            else:
                self.stats.seconds_out += seconds
        self._timings = pending
        return self.stats

    # ---- copies --------------------------------------------------------------------------

    def _timed(self, direction: str, kinds: list[CopyKind], fn, *args):  # type: ignore[no-untyped-def]
        """Run fn(*args) between two timing events on the current stream (args not empty): the
        window of the copies of `kinds`."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args)
        end.record()
        self._timings.append((direction, start, end))
        window = CopyWindow(events=(start, end))
        for kind in kinds:
            self.windows[kind] = window
        return result

    def _host_timed(self, kind: CopyKind, fn, ops: list[CopyOp], *args) -> None:  # type: ignore[no-untyped-def]
        """Run fn(ops, *args), copies the host makes itself, on the host clock."""
        if not ops:
            return
        start_ns, begin = time.time_ns(), time.perf_counter_ns()
        fn(ops, *args)
        took = time.perf_counter_ns() - begin
        self.windows[kind] = CopyWindow(start_ns, start_ns + took)
        if kind is CopyKind.SWAP_IN:
            self.stats.seconds_in += took / 1e9
        else:
            self.stats.seconds_out += took / 1e9

    def _copy_out(self, ops: list[CopyOp], max_programs: int | None, dma: bool = False) -> None:
        if not ops:
            return
        runs = copy_runs(ops)
        if self.batch is not None:
            self.batch.copy(range(len(self.gpu_caches)), runs, to_gpu=False)
        elif not dma and self._use_kernel(ops, runs):
            gpu_ids, cpu_ids = self._indices(ops)
            for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
                copy_blocks(gpu, cpu, gpu_ids, cpu_ids, max_programs)
        elif self.cuda:
            self._dma(range(len(self.gpu_caches)), runs, to_gpu=False)
        else:
            for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
                for g, c, n in runs:
                    cpu[c : c + n].copy_(gpu[g : g + n])
        self.stats.blocks_out += len(ops)
        self.stats.bytes_out += len(ops) * self.block_bytes

    def _copy_by_layer(self, evict: list[CopyOp], swap_in: list[CopyOp]) -> list[torch.cuda.Event]:
        """Per group of layers (`layer_groups`): save the evicted blocks, then load the
        swapped-in ones; one event each, listed once per layer of its group."""
        out_plan, in_plan = self._layer_plan(evict, False), self._layer_plan(swap_in, True)
        stream = torch.cuda.current_stream().cuda_stream
        events = []
        for layers in layer_groups(len(self.gpu_caches)):
            self._copy_layers(layers, out_plan, False, None, stream)
            self._copy_layers(layers, in_plan, True, IN_PROGRAMS, stream)
            event = torch.cuda.Event()
            event.record()
            events += [event] * len(layers)
        self.stats.blocks_out += len(evict)
        self.stats.bytes_out += len(evict) * self.block_bytes
        self.stats.blocks_in += len(swap_in)
        self.stats.bytes_in += len(swap_in) * self.block_bytes
        return events

    def _layer_plan(self, ops: list[CopyOp], to_gpu: bool) -> _LayerPlan | None:
        if not ops:
            return None
        runs = copy_runs(ops)
        if self.batch is not None:  # addresses made once here, not in each layer's call
            return _LayerPlan(runs, None, self.batch.plan(runs, to_gpu))
        if self._use_kernel(ops, runs):
            return _LayerPlan(runs, self._indices(ops))
        return _LayerPlan(runs, None)

    def _copy_layers(
        self,
        layers: range,
        plan: _LayerPlan | None,
        to_gpu: bool,
        max_programs: int | None,
        stream: int,
    ) -> None:
        """Consecutive layers of a planned copy, in one direction, on `stream` (the current
        stream's handle)."""
        if plan is None:
            return
        if plan.ids is not None:
            gpu_ids, cpu_ids = plan.ids
            for layer in layers:
                gpu, cpu = self.gpu_caches[layer], self.cpu_caches[layer]
                if to_gpu:
                    copy_blocks(cpu, gpu, cpu_ids, gpu_ids, max_programs)
                else:
                    copy_blocks(gpu, cpu, gpu_ids, cpu_ids, max_programs)
        elif plan.batch is not None:
            plan.batch.issue_range(layers, stream)
        else:
            self._dma(layers, plan.runs, to_gpu)

    def _dma(self, layers: Sequence[int], runs: list[tuple[int, int, int]], to_gpu: bool) -> None:
        """Copy-engine copies of `runs` in `layers`, issued in one call: a swap-out of scattered
        blocks makes a thousand of them a step, and the host issues them while the device
        runs the step before (each one, a slice and a call from Python, costs ~8 us)."""
        if self._views is None:  # every block of every layer as a view, made once
            self._views = (
                [cache.unbind(0) for cache in self.gpu_caches],
                [cache.unbind(0) for cache in self.cpu_caches],
            )
        gpu_views, cpu_views = self._views
        gpu_side: list[torch.Tensor] = []
        cpu_side: list[torch.Tensor] = []
        for layer in layers:
            gpu, cpu = self.gpu_caches[layer], self.cpu_caches[layer]
            for g, c, n in runs:
                gpu_side.append(gpu_views[layer][g] if n == 1 else gpu[g : g + n])
                cpu_side.append(cpu_views[layer][c] if n == 1 else cpu[c : c + n])
        if to_gpu:
            torch._foreach_copy_(gpu_side, cpu_side, non_blocking=True)
        else:
            torch._foreach_copy_(cpu_side, gpu_side, non_blocking=True)

    def _use_kernel(self, ops: list[CopyOp], runs: list[tuple[int, int, int]]) -> bool:
        return self.zero_copy and len(ops) < MIN_DMA_RUN * len(runs)

    def _indices(self, ops: list[CopyOp]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = torch.tensor([(op.gpu_block, op.cpu_slot) for op in ops], dtype=torch.int32)
        pairs = pairs.pin_memory().to(self.gpu_caches[0].device, non_blocking=True)
        return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()

    def _copy_in_all_layers(self, ops: list[CopyOp]) -> None:
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
            for g, c, n in copy_runs(ops):
                gpu[g : g + n].copy_(cpu[c : c + n])
        self.stats.blocks_in += len(ops)
        self.stats.bytes_in += len(ops) * self.block_bytes


@dataclass
class _LayerPlan:
    """A batch of block copies, prepared once and issued for every layer."""

    runs: list[tuple[int, int, int]]  # (gpu_start, cpu_start, length)
    ids: tuple[torch.Tensor, torch.Tensor] | None  # (gpu ids, cpu ids) for the copy kernel
    batch: LayerCopies | None = None  # the runs as the batched copier issues them


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
