"""Many host<->device copies in one driver call (`cuMemcpyBatchAsync`, CUDA 12.8 and later).

A swap moves scattered 160 KB block runs of every layer. Issued one `cudaMemcpyAsync` each (a
thousand a step), they cost the host ~10 us per copy and the copy engines reach only half the PCIe
rate, as each small copy waits for its own setup; the copy kernel reaches the rate but holds SMs
beside the forward. One batched call hands the driver the whole list: the copies run at nearly
the pinned-memory peak, for a fraction of the host time, with no SM used.

The driver entry point is reached through ctypes; torch does not expose it. `BatchCopier.create`
returns None where it is missing (older drivers, no GPU) or where a probe copy comes back wrong,
and the swap engine then keeps its other paths.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_SRC_ACCESS_ORDER_STREAM = 1  # the copy reads its source in stream order
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location", _Location),
        ("dst_location", _Location),
        ("flags", ctypes.c_uint),
    ]


def driver_entry_point() -> tuple[Any, bool] | None:
    """The driver's batched copy (a ctypes function) and whether it takes a failure index, or
    None where the driver (or the call) is missing."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    head: list[Any] = [pointer, pointer, pointer, size, pointer, pointer, size]
    if hasattr(driver, "cuMemcpyBatchAsync_v2"):  # CUDA 13: no failure index
        function, has_fail_index = driver.cuMemcpyBatchAsync_v2, False
        function.argtypes = [*head, pointer]
    elif hasattr(driver, "cuMemcpyBatchAsync"):  # CUDA 12.8 and 12.9
        function, has_fail_index = driver.cuMemcpyBatchAsync, True
        function.argtypes = [*head, pointer, pointer]
    else:
        return None
    function.restype = ctypes.c_int
    return function, has_fail_index


class BatchCopier:
    """Copies runs of whole blocks between per-layer GPU and CPU block tensors of equal shape."""

    def __init__(
        self,
        function: Any,  # the driver's entry point (a ctypes function)
        has_fail_index: bool,
        gpu_caches: Sequence[torch.Tensor],
        cpu_caches: Sequence[torch.Tensor],
    ) -> None:
        self._function = function
        self._has_fail_index = has_fail_index
        device = gpu_caches[0].device.index or 0
        self._attributes = {
            to_gpu: _Attributes(
                _SRC_ACCESS_ORDER_STREAM,
                _Location(_LOCATION_HOST if to_gpu else _LOCATION_DEVICE, 0 if to_gpu else device),
                _Location(_LOCATION_DEVICE if to_gpu else _LOCATION_HOST, device if to_gpu else 0),
                0,
            )
            for to_gpu in (False, True)
        }
        self._first = (ctypes.c_size_t * 1)(0)  # one set of attributes, from the first copy on
        self._fail_index = ctypes.c_size_t()
        # what follows (destinations, sources, sizes, count) in every call, before the stream
        self._tail = {
            to_gpu: (ctypes.byref(self._attributes[to_gpu]), self._first, 1)
            + ((ctypes.byref(self._fail_index),) if has_fail_index else ())
            for to_gpu in (False, True)
        }
        self.block_bytes = gpu_caches[0][0].numel() * gpu_caches[0].element_size()
        self._gpu = np.array([cache.data_ptr() for cache in gpu_caches], dtype=np.uint64)
        self._cpu = np.array([cache.data_ptr() for cache in cpu_caches], dtype=np.uint64)

    @classmethod
    def create(
        cls, gpu_caches: Sequence[torch.Tensor], cpu_caches: Sequence[torch.Tensor]
    ) -> BatchCopier | None:
        """A copier for these tiers, or None if the driver has no batched copy or it fails a
        probe (two blocks out and back, compared)."""
        if not gpu_caches or not gpu_caches[0].is_cuda or not cpu_caches or len(cpu_caches[0]) < 2:
            return None
        entry = driver_entry_point()
        if entry is None:
            return None
        copier = cls(*entry, gpu_caches, cpu_caches)
        try:
            return copier if copier._probe(gpu_caches[0], cpu_caches[0]) else None
        except Exception:  # noqa: BLE001 - any failure: the swap engine keeps its other paths
            return None

    def plan(self, runs: Sequence[tuple[int, int, int]], to_gpu: bool) -> LayerCopies:
        """(gpu_start, cpu_start, length) block runs, in one direction, ready to be issued layer
        by layer or for many layers at once."""
        return LayerCopies(self, runs, to_gpu)

    def copy(self, layers: range, runs: Sequence[tuple[int, int, int]], to_gpu: bool) -> None:
        """Copy the block runs in consecutive `layers` on the current stream (not the legacy
        default stream, which the driver refuses); the host's part is done when it returns."""
        self.plan(runs, to_gpu).issue(layers, torch.cuda.current_stream().cuda_stream)

    def _probe(self, gpu: torch.Tensor, cpu: torch.Tensor) -> bool:
        saved_gpu, saved_cpu = gpu[:2].clone(), cpu[:2].clone()
        probe = torch.randn(gpu[:2].shape, device=gpu.device).to(gpu.dtype)
        gpu[:2] = probe
        side = torch.cuda.Stream(gpu.device)  # the driver refuses the legacy default stream
        side.wait_stream(torch.cuda.current_stream(gpu.device))
        with torch.cuda.stream(side):
            self.copy(range(1), [(0, 1, 1), (1, 0, 1)], to_gpu=False)  # crossed: 0 -> slot 1
        torch.cuda.synchronize(gpu.device)
        out = torch.equal(cpu[1].to(gpu.device), probe[0]) and torch.equal(
            cpu[0].to(gpu.device), probe[1]
        )
        gpu[:2] = 0
        side.wait_stream(torch.cuda.current_stream(gpu.device))
        with torch.cuda.stream(side):
            self.copy(range(1), [(0, 0, 2)], to_gpu=True)
        torch.cuda.synchronize(gpu.device)
        back = torch.equal(gpu[0], probe[1]) and torch.equal(gpu[1], probe[0])
        gpu[:2], cpu[:2] = saved_gpu, saved_cpu
        return out and back


class LayerCopies:
    """One step's block runs in one direction, as the driver takes them: the destination and
    source address of every run in every layer, layer after layer, made in one array operation,
    so issuing a layer is one driver call and no array work (a pipelined swap-in issues 40 of
    them before its forward; building each call's arrays in Python would cost ~70 us)."""

    def __init__(
        self, copier: BatchCopier, runs: Sequence[tuple[int, int, int]], to_gpu: bool
    ) -> None:
        table = np.array(runs, dtype=np.uint64).reshape(-1, 3) * np.uint64(copier.block_bytes)
        num_layers, self.num_runs = len(copier._gpu), len(table)
        gpu = copier._gpu[:, None] + table[None, :, 0]  # [layers, runs]
        cpu = copier._cpu[:, None] + table[None, :, 1]
        dst, src = (gpu, cpu) if to_gpu else (cpu, gpu)
        self._dst, self._src = np.ascontiguousarray(dst), np.ascontiguousarray(src)
        self._sizes = np.ascontiguousarray(np.tile(table[:, 2], num_layers))
        self._row = 8 * self.num_runs  # bytes of one layer's addresses
        self._dst_at, self._src_at = self._dst.ctypes.data, self._src.ctypes.data
        self._sizes_at = self._sizes.ctypes.data
        self._function, self._tail = copier._function, copier._tail[to_gpu]

    def issue(self, layers: range, stream: int) -> None:
        """Copy the runs in consecutive `layers` on `stream` (a CUDA stream handle), in calls of
        1, 2, 4, ... layers: the driver starts none of a call's copies before the call returns,
        so one call for all 40 layers of a scattered swap-out (~1.3 ms of host time) would leave
        the copy engines idle that long. With the first call one layer, the engines start almost
        at once, and each later call is issued while the ones before still copy, which keeps
        them near the PCIe rate."""
        if layers.step != 1:
            raise ValueError(f"layers must be consecutive, not {layers}")
        if not self.num_runs:
            return
        begin, size = layers.start, 1
        while begin < layers.stop:
            count = min(size, layers.stop - begin)
            self._call(begin, count, stream)
            begin, size = begin + count, size * 2

    def issue_range(self, layers: range, stream: int) -> None:
        """Copy the runs in consecutive `layers` on `stream` in one call: a pipelined swap-in's
        group of layers."""
        if layers.step != 1:
            raise ValueError(f"layers must be consecutive, not {layers}")
        if self.num_runs and len(layers):
            self._call(layers.start, len(layers), stream)

    def _call(self, layer: int, count: int, stream: int) -> None:
        offset = layer * self._row
        status = self._function(
            self._dst_at + offset,
            self._src_at + offset,
            self._sizes_at,
            count * self.num_runs,
            *self._tail,
            stream,
        )
        if status != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {status}")
