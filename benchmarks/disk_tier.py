"""The disk tier's copy rates against the disk's own, on the machine it runs on:

    python -m benchmarks.disk_tier --dir /path/on/the/disk [--chunks 64,256,1024] [--dd-gib 8]

First the disk's sequential rate with direct I/O (`dd` with `oflag=direct` / `iflag=direct`,
4 MiB blocks, the write ended by an fsync), then the tier (`store/disk`) writing chunks of a
Llama-3.1-8B shape (32 layers of 32 tokens x 8 KV heads x 128 x bf16 for K and V: 4 MiB a
chunk) from CPU-tier blocks scattered through pinned host memory (as the executor's CPU tier
holds them) and reading them back into other scattered blocks, checksums and index included.
The last lines are a table: each rate in GB/s and against the disk's own.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pensieve.actors.executor.disk_views import chunk_geometry, chunk_views
from pensieve.store.disk import DiskConfig, DiskTier
from pensieve.store.disk.slot_io import is_aligned

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 32, 32, 8, 128  # Llama-3.1-8B's KV, 32-token chunks


def dd_rate(path: Path, gib: int) -> tuple[float, float]:
    """Sequential write then read of `gib` GiB with direct I/O, in GB/s."""
    count = gib * 256  # 4 MiB blocks
    begin = time.perf_counter()
    subprocess.run(
        [
            "dd",
            "if=/dev/zero",
            f"of={path}",
            "bs=4M",
            f"count={count}",
            "oflag=direct",
            "conv=fsync",
        ],
        check=True,
        capture_output=True,
    )
    write = count * 4 * 2**20 / (time.perf_counter() - begin) / 1e9
    begin = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
        check=True,
        capture_output=True,
    )
    read = count * 4 * 2**20 / (time.perf_counter() - begin) / 1e9
    path.unlink()
    return write, read


def cpu_tier(num_blocks: int) -> list[torch.Tensor]:
    """Per layer [num_blocks, 2, 32, 8, 128] bf16, pinned where CUDA is (as the executor's)."""
    pin = torch.cuda.is_available()
    caches = []
    for _ in range(LAYERS):
        cache = torch.empty(
            (num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, pin_memory=pin
        )
        cache.view(torch.int16).random_(-(2**15), 2**15 - 1)
        caches.append(cache)
    return caches


def tier_rates(root: Path, caches: list[torch.Tensor], num: int) -> tuple[float, float, str]:
    """Write `num` scattered blocks' chunks, then read them into other scattered blocks."""
    geometry = chunk_geometry(caches)
    directory = Path(tempfile.mkdtemp(dir=root))
    blocks = caches[0].shape[0]
    order = random.sample(range(blocks), blocks)
    sources, targets = order[:num], order[num : 2 * num] if 2 * num <= blocks else order[:num]
    keys = [random.randbytes(16) for _ in range(num)]
    config = DiskConfig(directory, (num + 8) * geometry.slot_bytes)
    with DiskTier.open(config, geometry, "bench") as tier:
        begin = time.perf_counter()
        written = tier.write(
            [(k, chunk_views(caches, b)) for k, b in zip(keys, sources, strict=True)]
        )
        write_s = time.perf_counter() - begin
        assert len(written) == num, f"wrote {len(written)} of {num}"
        begin = time.perf_counter()
        found = tier.read([(k, chunk_views(caches, b)) for k, b in zip(keys, targets, strict=True)])
        read_s = time.perf_counter() - begin
        assert all(found)
        method = tier.io_method.value
    for source, target in zip(sources, targets, strict=True):  # the bytes came back
        same = caches[0][source].view(torch.int16), caches[0][target].view(torch.int16)
        assert torch.equal(*same)  # (as integers: random bits are NaNs as bf16)
    shutil.rmtree(directory)
    total = num * geometry.chunk_bytes
    return total / write_s / 1e9, total / read_s / 1e9, method


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--chunks", default="64,256,1024")
    parser.add_argument("--dd-gib", type=int, default=8)
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.chunks.split(",")]
    dd_write, dd_read = dd_rate(args.dir / "dd.bin", args.dd_gib)
    caches = cpu_tier(2 * max(counts))
    aligned = all(is_aligned(chunk_views(caches, b)) for b in range(caches[0].shape[0]))
    rows = [("dd, sequential", dd_write, dd_read, "direct")]
    for num in counts:
        write, read, method = tier_rates(args.dir, caches, num)
        rows.append((f"tier, {num} chunks", write, read, method))
    print(f"directory {args.dir}; pinned blocks page-aligned: {aligned}")
    print(f"{'what':<20} {'write GB/s':>10} {'of dd':>6} {'read GB/s':>10} {'of dd':>6}  I/O")
    for name, write, read, method in rows:
        print(
            f"{name:<20} {write:10.2f} {write / dd_write:6.2f} {read:10.2f} "
            f"{read / dd_read:6.2f}  {method}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
