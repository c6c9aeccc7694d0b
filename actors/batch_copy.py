"""Many host<->device copies in one driver call (`cuMemcpyBatchAsync`, CUDA 12.8 and later).

A swap moves scattered 160 KB block runs of every layer. Issued one `cudaMemcpyAsync` each (a
thousand a step), the host spent ~10 us per copy and the copy engines reached only half the PCIe
rate, as each small copy waits for its own setup; the copy kernel reaches the rate but holds SMs
beside the forward. One batched call hands the driver the whole list: on an H200 it issued 2960
copies in 2 ms of host time and moved them at 54 GB/s (the pinned peak is 55), with no SM used.

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


class BlockRuns:
    """(gpu_start, cpu_start, length) block runs as byte offsets within a layer's tensors and
    byte sizes: what every layer's copy of the same runs shares, made once per step."""

    def __init__(self, runs: Sequence[tuple[int, int, int]], block_bytes: int) -> None:
        table = np.array(runs, dtype=np.uint64).reshape(-1, 3) * np.uint64(block_bytes)
        self.gpu = np.ascontiguousarray(table[:, 0])
        self.cpu = np.ascontiguousarray(table[:, 1])
        self.sizes = np.ascontiguousarray(table[:, 2])

    def __len__(self) -> int:
        return len(self.sizes)


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

    def prepare(self, runs: Sequence[tuple[int, int, int]]) -> BlockRuns:
        """The runs in the form `copy` takes, for copying them in many layers one by one."""
        return BlockRuns(runs, self.block_bytes)

    def copy(
        self,
        layers: Sequence[int],
        runs: Sequence[tuple[int, int, int]] | BlockRuns,
        to_gpu: bool,
    ) -> None:
        """Copy (gpu_start, cpu_start, length) block runs of `layers` on the current stream (not
        the legacy default stream, which the driver refuses); the host's part is done when it
        returns.

        Many layers go in calls of 1, 2, 4, ... layers: the driver starts none of a call's copies
        before the call returns, so one call for all 40 layers of a scattered swap-out (2560
        copies, ~1.3 ms of host time) left the copy engines idle that long, and a 64-chunk copy
        reached 0.85 of the PCIe rate. With the first call one layer, the engines start after
        ~50 us, and each later call is issued while the ones before still copy (H200: 0.99)."""
        if not len(runs) or not layers:
            return
        table = runs if isinstance(runs, BlockRuns) else self.prepare(runs)
        chosen = np.asarray(layers, dtype=np.int64)
        begin, size = 0, 1
        while begin < len(chosen):
            self._call(chosen[begin : begin + size], table, to_gpu)
            begin, size = begin + size, size * 2

    def _call(self, layers: np.ndarray, table: BlockRuns, to_gpu: bool) -> None:
        """One driver call: `table`'s runs in each of `layers`."""
        if len(layers) == 1:  # a pipelined swap-in's call: two additions
            gpu = self._gpu[layers[0]] + table.gpu
            cpu = self._cpu[layers[0]] + table.cpu
            sizes = table.sizes
        else:
            gpu = (self._gpu[layers][:, None] + table.gpu[None, :]).ravel()
            cpu = (self._cpu[layers][:, None] + table.cpu[None, :]).ravel()
            sizes = np.tile(table.sizes, len(layers))
        dst, src = (gpu, cpu) if to_gpu else (cpu, gpu)
        args: list[object] = [
            dst.ctypes.data,
            src.ctypes.data,
            sizes.ctypes.data,
            len(sizes),
            ctypes.byref(self._attributes[to_gpu]),
            self._first,
            1,
        ]
        if self._has_fail_index:
            args.append(ctypes.byref(self._fail_index))
        status = self._function(*args, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if status != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {status}")

    def _probe(self, gpu: torch.Tensor, cpu: torch.Tensor) -> bool:
        saved_gpu, saved_cpu = gpu[:2].clone(), cpu[:2].clone()
        probe = torch.randn(gpu[:2].shape, device=gpu.device).to(gpu.dtype)
        gpu[:2] = probe
        side = torch.cuda.Stream(gpu.device)  # the driver refuses the legacy default stream
        side.wait_stream(torch.cuda.current_stream(gpu.device))
        with torch.cuda.stream(side):
            self.copy([0], [(0, 1, 1), (1, 0, 1)], to_gpu=False)  # crossed: block 0 -> slot 1
        torch.cuda.synchronize(gpu.device)
        out = torch.equal(cpu[1].to(gpu.device), probe[0]) and torch.equal(
            cpu[0].to(gpu.device), probe[1]
        )
        gpu[:2] = 0
        side.wait_stream(torch.cuda.current_stream(gpu.device))
        with torch.cuda.stream(side):
            self.copy([0], [(0, 0, 2)], to_gpu=True)
        torch.cuda.synchronize(gpu.device)
        back = torch.equal(gpu[0], probe[1]) and torch.equal(gpu[1], probe[0])
        gpu[:2], cpu[:2] = saved_gpu, saved_cpu
        return out and back
