"""Swap copies three ways on one GPU: batched driver calls (`cuMemcpyBatchAsync`, what the swap
engine uses), one DMA call per block and layer, and the zero-copy copy kernel; how much each
slows a matmul-heavy 40-layer forward that waits on it layer by layer, as a pipelined swap-in
does; and how much an ahead-of-time swap-out slows a decode-like step beside it. Scattered
blocks of preset:llama2-13b-gqa10's shape (160 KB per block and layer).

    python3 -m benchmarks.probe_swap_copies        (CUDA only; ~1 minute, 13 GB pinned)
"""

import ctypes
import time

import numpy as np
import torch

from pensieve.kernels.block_copy import copy_blocks


def main() -> None:
    dev = torch.device("cuda")
    L, N, BLOCK = 40, 1024, (2, 32, 10, 128)
    gpu = [torch.zeros((N, *BLOCK), dtype=torch.bfloat16, device=dev) for _ in range(L)]
    t0 = time.perf_counter()
    cpu = [torch.empty((N, *BLOCK), dtype=torch.bfloat16, pin_memory=True) for _ in range(L)]
    for c in cpu:
        c.fill_(1.0)
    print(f"pinned alloc {time.perf_counter() - t0:.1f}s")
    bb = gpu[0][0].numel() * 2

    cuda = ctypes.CDLL("libcuda.so.1")
    ver = ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(ver))
    print(
        "driver",
        ver.value,
        "v1",
        hasattr(cuda, "cuMemcpyBatchAsync"),
        "v2",
        hasattr(cuda, "cuMemcpyBatchAsync_v2"),
    )

    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Attrs(ctypes.Structure):
        _fields_ = [("order", ctypes.c_int), ("src", Loc), ("dst", Loc), ("flags", ctypes.c_uint)]

    P = ctypes.c_void_p
    use_v2 = hasattr(cuda, "cuMemcpyBatchAsync_v2")
    fn = cuda.cuMemcpyBatchAsync_v2 if use_v2 else cuda.cuMemcpyBatchAsync
    if use_v2:
        fn.argtypes = [P, P, P, ctypes.c_size_t, P, P, ctypes.c_size_t, P]
    else:
        fn.argtypes = [P, P, P, ctypes.c_size_t, P, P, ctypes.c_size_t, P, P]
    fn.restype = ctypes.c_int

    def attrs_for(to_gpu, flags):
        a = Attrs()
        a.order = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        a.src = Loc(2 if to_gpu else 1, 0)
        a.dst = Loc(1 if to_gpu else 2, 0)
        a.flags = flags
        return a

    fail = ctypes.c_size_t()
    idx = (ctypes.c_size_t * 1)(0)

    def batch(dst, src, sizes, to_gpu, flags=0):
        a = attrs_for(to_gpu, flags)
        stream = torch.cuda.current_stream().cuda_stream
        args = [
            dst.ctypes.data,
            src.ctypes.data,
            sizes.ctypes.data,
            len(dst),
            ctypes.byref(a),
            idx,
            1,
        ]
        args += [] if use_v2 else [ctypes.byref(fail)]
        rc = fn(*args, P(stream))
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync rc={rc}")

    rng = np.random.default_rng(0)
    gbase = np.array([g.data_ptr() for g in gpu], dtype=np.uint64)
    cbase = np.array([c.data_ptr() for c in cpu], dtype=np.uint64)

    def plan(nblocks):
        gid = rng.choice(N, nblocks, replace=False).astype(np.uint64)
        cid = rng.choice(N, nblocks, replace=False).astype(np.uint64)
        return gid, cid

    def swap_in_batch(gid, cid, flags=0):
        sizes = np.full(len(gid), bb, dtype=np.uint64)
        evs = []
        for layer in range(L):
            batch(gbase[layer] + gid * bb, cbase[layer] + cid * bb, sizes, True, flags)
            e = torch.cuda.Event()
            e.record()
            evs.append(e)
        return evs

    def swap_out_batch(gid, cid):
        n = len(gid)
        dst = (cbase[:, None] + cid[None, :] * bb).ravel()
        src = (gbase[:, None] + gid[None, :] * bb).ravel()
        batch(dst, src, np.full(n * L, bb, dtype=np.uint64), False)

    views = ([g.unbind(0) for g in gpu], [c.unbind(0) for c in cpu])

    def swap_in_foreach(gid, cid):
        evs = []
        for layer in range(L):
            torch._foreach_copy_(
                [views[0][layer][int(g)] for g in gid],
                [views[1][layer][int(c)] for c in cid],
                non_blocking=True,
            )
            e = torch.cuda.Event()
            e.record()
            evs.append(e)
        return evs

    def swap_out_foreach(gid, cid):
        d, s = [], []
        for layer in range(L):
            for g, c in zip(gid, cid, strict=True):
                d.append(views[1][layer][int(c)])
                s.append(views[0][layer][int(g)])
        torch._foreach_copy_(d, s, non_blocking=True)

    def swap_in_kernel(gid, cid, programs=32):
        g = torch.tensor(gid.astype(np.int64), dtype=torch.int32, device=dev)
        c = torch.tensor(cid.astype(np.int64), dtype=torch.int32, device=dev)
        evs = []
        for layer in range(L):
            copy_blocks(cpu[layer], gpu[layer], c, g, programs)
            e = torch.cuda.Event()
            e.record()
            evs.append(e)
        return evs

    def check(gid, cid):
        for layer in (0, L - 1):
            for g, c in list(zip(gid, cid, strict=True))[:3]:
                assert torch.equal(gpu[layer][int(g)].cpu(), cpu[layer][int(c)]), "mismatch"

    def timed(label, fn, *args, stream=None, reps=5):
        s = stream or torch.cuda.current_stream()
        host, dev_ms = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record()
                t = time.perf_counter()
                fn(*args)
                host.append(time.perf_counter() - t)
                b.record()
            torch.cuda.synchronize()
            dev_ms.append(a.elapsed_time(b))
        h, d = 1e3 * min(host), min(dev_ms)
        n = len(args[0]) * L
        print(f"{label:40s} host {h:7.2f} ms  device {d:7.2f} ms  {n * bb / d / 1e6:6.1f} GB/s")
        return h, d

    side = torch.cuda.Stream(priority=-64)
    for nb in (30, 74):
        gid, cid = plan(nb)
        for c in cpu:
            c[torch.from_numpy(cid.astype(np.int64))] = torch.randn((nb, *BLOCK)).to(torch.bfloat16)
        print(f"--- {nb} scattered blocks x {L} layers ({nb * L * bb / 1e6:.0f} MB)")
        timed("swap-in batch API", swap_in_batch, gid, cid, stream=side)
        check(gid, cid)
        gpu[0].zero_()
        gpu[L - 1].zero_()
        timed("swap-in foreach DMA", swap_in_foreach, gid, cid, stream=side)
        check(gid, cid)
        gpu[0].zero_()
        gpu[L - 1].zero_()
        timed("swap-in copy kernel 32", swap_in_kernel, gid, cid, stream=side)
        check(gid, cid)
        timed("swap-out batch API", swap_out_batch, gid, cid, stream=side)
        timed("swap-out foreach DMA", swap_out_foreach, gid, cid, stream=side)

    # a matmul-heavy "forward" beside a 74-block swap-in
    M = 800
    x = torch.randn(M, 5120, dtype=torch.bfloat16, device=dev)
    w1 = torch.randn(5120, 2 * 13824, dtype=torch.bfloat16, device=dev) / 100
    w2 = torch.randn(13824, 5120, dtype=torch.bfloat16, device=dev) / 100
    wq = torch.randn(5120, 5120 + 2560, dtype=torch.bfloat16, device=dev) / 100
    wo = torch.randn(5120, 5120, dtype=torch.bfloat16, device=dev) / 100

    def forward(evs=None):
        h = x
        for layer in range(L):
            if evs is not None:
                torch.cuda.current_stream().wait_event(evs[layer])
            q = h @ wq
            h = q[:, :5120] @ wo
            u = h @ w1
            h = (u[:, :13824] * u[:, 13824:]) @ w2
        return h

    def beside(copies, step, copy_stream, gid, cid, reps=5):  # type: ignore[no-untyped-def]
        """Best device ms of `step(events)` with `copies(gid, cid)` issued just before it on
        `copy_stream` (events: what `copies` returned; None without copies)."""
        best = 1e9
        for _ in range(reps):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            evs = None
            if copies is not None:
                copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copy_stream):
                    evs = copies(gid, cid)
            step(evs)
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b))
        return best

    gid, cid = plan(74)
    for name, swap in (
        ("none", None),
        ("copy kernel", swap_in_kernel),
        ("batch API", swap_in_batch),
        ("foreach DMA", swap_in_foreach),
    ):
        best = beside(swap, forward, side, gid, cid)
        print(f"forward ({M} tokens x {L} layers) with swap-in by {name:12s}: {best:7.2f} ms")

    # A decode-like step: 250 rows through the same weights, and per layer a read of 200 MB
    # standing in for the KV of 250 sequences at ~1k positions. Alone, and beside an
    # ahead-of-time swap-out of 30 blocks on a default-priority stream (the swap engine's
    # out-stream), by the batch API and by the copy kernel with 16 programs.
    rows = x[:250].contiguous()
    kv = torch.ones((L, 100_000_000), dtype=torch.bfloat16, device=dev)

    def decode_step(_: object = None) -> torch.Tensor:
        h = rows
        for layer in range(L):
            q = h @ wq
            h = q[:, :5120] @ wo + kv[layer].sum()
            u = h @ w1
            h = (u[:, :13824] * u[:, 13824:]) @ w2
        return h

    def swap_out_kernel(gid: np.ndarray, cid: np.ndarray) -> None:
        g = torch.tensor(gid.astype(np.int64), dtype=torch.int32, device=dev)
        c = torch.tensor(cid.astype(np.int64), dtype=torch.int32, device=dev)
        for layer in range(L):
            copy_blocks(gpu[layer], cpu[layer], g, c, 16)

    out = torch.cuda.Stream()
    gid, cid = plan(30)
    for name, swap_out in (
        ("none", None),
        ("batch API", swap_out_batch),
        ("copy kernel 16", swap_out_kernel),
    ):
        best = beside(swap_out, decode_step, out, gid, cid)
        label = f"decode-like step (250 rows, 8 GB read) beside swap-out by {name}"
        print(f"{label:68s}: {best:7.2f} ms")


if __name__ == "__main__":
    main()
