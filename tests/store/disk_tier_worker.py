"""A process that drives a disk tier, for the tests that kill it, limit its file sizes or give
it a small file system: `python disk_tier_worker.py MODE DIR [ARG]`.

    churn DIR SEED   write chunks for ever, removing some whenever the tier is full
                     (so slots are reused), printing "written" after the first write
    fill DIR [LIMIT] write one chunk at a time until writes are off (after setting
                     RLIMIT_FSIZE to LIMIT bytes, if given), then read every chunk back;
                     prints a JSON summary
    open DIR         open the tier; prints its I/O method ("direct", "buffered") or the
                     DiskTierError
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import resource
import signal
import sys
from pathlib import Path

import numpy as np

from pensieve.store.disk import ChunkGeometry, DiskConfig, DiskTier, DiskTierError

GEOMETRY = ChunkGeometry(num_layers=8, layer_bytes=16384)  # 128 KiB chunks
MODEL = "worker-model"


def key_of(number: int) -> bytes:
    return hashlib.blake2b(number.to_bytes(8, "little"), digest_size=16).digest()


def content(key: bytes, geometry: ChunkGeometry = GEOMETRY) -> list[memoryview]:
    """A chunk's bytes, made from its key (so a reader knows what each key must hold)."""
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    data = rng.integers(0, 256, geometry.chunk_bytes, dtype=np.uint8)
    return [memoryview(part) for part in np.split(data, geometry.num_layers)]


def empty(geometry: ChunkGeometry = GEOMETRY) -> list[memoryview]:
    data = np.zeros(geometry.chunk_bytes, dtype=np.uint8)
    return [memoryview(part) for part in np.split(data, geometry.num_layers)]


def open_tier(path: Path, num_slots: int) -> DiskTier:
    return DiskTier.open(DiskConfig(path, num_slots * GEOMETRY.slot_bytes), GEOMETRY, MODEL)


def churn(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    tier = open_tier(path, 64)
    number = seed * 10**9
    while True:
        if tier.num_free < 8:
            tier.remove(rng.sample(tier.keys(), 16))
        keys = [key_of(number + i) for i in range(8)]
        number += 8
        tier.write([(key, content(key)) for key in keys])
        print("written", flush=True)


def fill(path: Path, num_slots: int, limit: int | None) -> None:
    tier = open_tier(path, num_slots)
    if limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    written: list[bytes] = []
    number = 0
    while tier.writable and number < num_slots:
        key = key_of(number)
        written += tier.write([(key, content(key))])
        number += 1
    refused = tier.write([(key_of(10**6), content(key_of(10**6)))])  # after writes went off
    out = {key: empty() for key in written}
    found = tier.read([(key, out[key]) for key in written])
    equal = all(bytes(b"".join(out[key])) == b"".join(content(key)) for key in written)
    summary = {
        "writable": tier.writable,
        "attempted": number,
        "written": len(written),
        "refused": len(refused),
        "read_back": sum(found),
        "equal": equal,
    }
    print(json.dumps(summary), flush=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    mode, path = sys.argv[1], Path(sys.argv[2])
    if mode == "churn":
        churn(path, int(sys.argv[3]))
    elif mode == "fill":
        fill(path, int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
    elif mode == "open":
        try:
            with open_tier(path, 4) as tier:
                print(tier.io_method.value)
        except DiskTierError as error:
            print(error)


if __name__ == "__main__":
    main()
