"""The disk tier on real files in tmp_path and a real LMDB: chunks read back as written, survive
a reopen and a SIGKILL mid-write, and faults (corruption, another model, a full or read-only
file system) are handled as docs/disk-tier.md says. File systems of their own (a small tmpfs,
ramfs, a read-only bind mount) are mounted in a private mount namespace where this runs as root.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pensieve.store.disk import (
    LAYOUT_VERSION,
    ChunkGeometry,
    DiskConfig,
    DiskTier,
    DiskTierError,
    IoMethod,
)
from pensieve.store.disk.index import DiskIndex
from pensieve.store.disk.layout import Entry
from tests.store.disk_tier_worker import GEOMETRY, MODEL, content, empty, key_of

WORKER = Path(__file__).with_name("disk_tier_worker.py")
ODD = ChunkGeometry(num_layers=3, layer_bytes=1000)  # unaligned pieces, a padded slot
CAN_MOUNT = os.geteuid() == 0 and shutil.which("unshare") is not None


def open_tier(
    path: Path,
    num_slots: int,
    geometry: ChunkGeometry = GEOMETRY,
    model: str = MODEL,
    method: IoMethod = IoMethod.AUTO,
) -> DiskTier:
    config = DiskConfig(path, num_slots * geometry.slot_bytes, io_method=method, num_threads=4)
    return DiskTier.open(config, geometry, model)


def chunks(numbers: range | list[int], geometry: ChunkGeometry = GEOMETRY) -> list:
    return [(key_of(n), content(key_of(n), geometry)) for n in numbers]


def read_back(tier: DiskTier, keys: list[bytes], geometry: ChunkGeometry = GEOMETRY) -> dict:
    """key -> whether it was found whole and equal to what was written."""
    out = {key: empty(geometry) for key in keys}
    found = tier.read([(key, out[key]) for key in keys])
    return {
        key: ok and b"".join(out[key]) == b"".join(content(key, geometry))
        for key, ok in zip(keys, found, strict=True)
    }


def slot_of(path: Path, key: bytes) -> int:
    index = DiskIndex(path / "index", 1)
    try:
        entry = Entry.decode(index.entries()[key])
    finally:
        index.close()
    assert entry is not None
    return entry.slot


def worker(*args: object, mount: str | None = None, timeout: float = 120) -> tuple[str, str]:
    """Run the worker (in a private mount namespace after `mount`, a shell command, if given);
    its stdout and stderr."""
    command = [sys.executable, str(WORKER), *map(str, args)]
    if mount is not None:
        command = ["unshare", "--mount", "sh", "-c", f'{mount} && exec "$@"', "sh", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.mark.parametrize("geometry", [GEOMETRY, ODD], ids=["aligned", "odd"])
@pytest.mark.parametrize("method", [IoMethod.AUTO, IoMethod.BUFFERED])
def test_scattered_chunks_read_back_as_written(
    tmp_path: Path, geometry: ChunkGeometry, method: IoMethod
) -> None:
    with open_tier(tmp_path, 96, geometry, method=method) as tier:
        for begin in range(0, 96, 16):
            assert len(tier.write(chunks(range(begin, begin + 16), geometry))) == 16
        removed = [key_of(n) for n in range(0, 96, 3)]
        assert tier.remove(removed) == 32
        # the new chunks land in the freed slots, scattered over the file
        assert len(tier.write(chunks(range(100, 132), geometry))) == 32
        assert tier.num_free == 0
        held = tier.keys()
        random.Random(0).shuffle(held)
        assert all(read_back(tier, held, geometry).values())
        assert not any(read_back(tier, removed, geometry).values())


def test_chunks_and_index_survive_a_reopen(tmp_path: Path) -> None:
    with open_tier(tmp_path, 32) as tier:
        written = tier.write(chunks(range(20)))
        tier.remove(written[:5])
    with open_tier(tmp_path, 32) as tier:
        assert sorted(tier.keys()) == sorted(written[5:])
        assert tier.num_free == 32 - 15
        assert all(read_back(tier, written[5:]).values())
        assert len(tier.write(chunks(range(20, 37)))) == 17  # the free slots, no more


def test_a_chunk_on_disk_is_not_written_again(tmp_path: Path) -> None:
    with open_tier(tmp_path, 8) as tier:
        assert len(tier.write(chunks(range(4)))) == 4
        assert tier.write(chunks(range(4))) == []
        assert tier.num_free == 4


def test_the_budget_is_a_hard_bound(tmp_path: Path) -> None:
    with open_tier(tmp_path, 10) as tier:
        assert len(tier.write(chunks(range(15)))) == 10
        assert tier.write(chunks(range(15, 20))) == []
        tier.remove([key_of(n) for n in range(3)])
        assert len(tier.write(chunks(range(15, 20)))) == 3
    assert (tmp_path / "slots.bin").stat().st_size == 10 * GEOMETRY.slot_bytes


def test_kill_during_write_back_leaves_only_whole_chunks(tmp_path: Path) -> None:
    rng = random.Random(41)
    for round_ in range(8):
        process = subprocess.Popen(
            [sys.executable, str(WORKER), "churn", str(tmp_path), str(round_ + 1)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        assert process.stdout.readline() == "written\n", process.stderr
        time.sleep(rng.uniform(0.0, 0.4))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        with open_tier(tmp_path, 64) as tier:
            keys = tier.keys()
            assert len(keys) >= 8
            intact = read_back(tier, keys)
            assert all(intact.values()), f"round {round_}: {list(intact.values()).count(False)}"
            assert tier.num_chunks == len(keys)  # no entry dropped as torn


def test_a_corrupt_chunk_reads_as_missing_and_its_entry_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with open_tier(tmp_path, 16) as tier:
        written = tier.write(chunks(range(8)))
    victim = written[3]
    with open(tmp_path / "slots.bin", "r+b") as file:
        file.seek(slot_of(tmp_path, victim) * GEOMETRY.slot_bytes + 70_000)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x01]))
    with open_tier(tmp_path, 16) as tier, caplog.at_level(logging.WARNING):
        intact = read_back(tier, written)
        assert [key for key, ok in intact.items() if not ok] == [victim]
        assert victim not in tier
        assert "read back torn, corrupt or unreadable" in caplog.text
    with open_tier(tmp_path, 16) as tier:  # dropped from the index too
        assert sorted(tier.keys()) == sorted(set(written) - {victim})
        assert tier.write(chunks([3])) == [victim]
        assert read_back(tier, [victim])[victim]


def test_another_models_directory_is_not_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with open_tier(tmp_path, 16, model="model-a") as tier:
        written = tier.write(chunks(range(8)))
    with caplog.at_level(logging.WARNING), open_tier(tmp_path, 16, model="model-b") as tier:
        assert tier.num_chunks == 0
        assert not any(read_back(tier, written).values())
    assert "another model fingerprint" in caplog.text
    with open_tier(tmp_path, 16, model="model-a") as tier:  # laid out anew for model-b
        assert tier.num_chunks == 0


def test_another_geometry_or_an_older_layout_is_not_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with open_tier(tmp_path, 16) as tier:
        tier.write(chunks(range(8)))
    with caplog.at_level(logging.WARNING), open_tier(tmp_path, 16, ODD) as tier:
        assert tier.num_chunks == 0
    assert "another chunk geometry" in caplog.text
    with open_tier(tmp_path, 16) as tier:
        tier.write(chunks(range(8)))
    index = DiskIndex(tmp_path / "index", 16)
    header = index.header()
    assert header is not None
    index.update(header=(LAYOUT_VERSION - 1).to_bytes(4, "little") + header[4:])
    index.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING), open_tier(tmp_path, 16) as tier:
        assert tier.num_chunks == 0
    assert f"layout version {LAYOUT_VERSION - 1}" in caplog.text


def test_a_slot_file_cut_short_drops_the_chunks_past_its_end(tmp_path: Path) -> None:
    with open_tier(tmp_path, 10) as tier:
        written = tier.write(chunks(range(10)))
    within = [key for key in written if slot_of(tmp_path, key) < 5]
    os.truncate(tmp_path / "slots.bin", 5 * GEOMETRY.slot_bytes + 100)
    with open_tier(tmp_path, 10) as tier:
        kept = tier.keys()
        assert len(within) == 5 and sorted(kept) == sorted(within)
        assert all(read_back(tier, kept).values())
    assert (tmp_path / "slots.bin").stat().st_size == 10 * GEOMETRY.slot_bytes


def test_a_smaller_budget_keeps_the_chunks_within_it(tmp_path: Path) -> None:
    with open_tier(tmp_path, 10) as tier:
        tier.write(chunks(range(10)))
    with open_tier(tmp_path, 6) as tier:
        assert tier.num_chunks == 6 and all(read_back(tier, tier.keys()).values())
    assert (tmp_path / "slots.bin").stat().st_size == 6 * GEOMETRY.slot_bytes


def test_a_file_size_limit_turns_writes_off_and_reads_go_on(tmp_path: Path) -> None:
    limit = 10 * GEOMETRY.slot_bytes + 100  # the 11th slot's write fails part way (EFBIG)
    out, err = worker("fill", tmp_path, 32, limit)
    summary = json.loads(out)
    assert summary == {
        "writable": False,
        "attempted": 11,
        "written": 10,
        "refused": 0,
        "read_back": 10,
        "equal": True,
    }
    assert err.count("writes are off") == 1


@pytest.mark.skipif(not CAN_MOUNT, reason="mounts a small tmpfs: needs root and unshare")
def test_a_full_file_system_turns_writes_off_and_reads_go_on(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # 64 slots of 128 KiB (8 MiB) on a 2 MiB file system: the slot file is sparse
    out, err = worker("fill", mnt, 64, mount=f"mount -t tmpfs -o size=2m tmpfs {mnt}")
    summary = json.loads(out)
    assert not summary["writable"] and 0 < summary["written"] < 16
    assert summary["read_back"] == summary["written"] and summary["equal"]
    assert summary["refused"] == 0
    assert "the file is sparse" in err
    assert err.count("writes are off") == 1


def test_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match="does not exist"):
        open_tier(tmp_path / "absent", 4)


def test_a_read_only_directory_is_a_clear_error(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    if os.geteuid() == 0:  # root writes through file modes: a read-only mount
        if not CAN_MOUNT:
            pytest.skip("root without unshare: no read-only mount")
        mount = f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache}"
        out, _ = worker("open", cache, mount=mount)
        assert "is not writable" in out
        return
    cache.chmod(0o555)
    with pytest.raises(DiskTierError, match="is not writable"):
        open_tier(cache, 4)


def test_a_directory_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with open_tier(tmp_path, 4), pytest.raises(DiskTierError, match="in use by another process"):
        open_tier(tmp_path, 4)
    open_tier(tmp_path, 4).close()  # free once closed


def test_a_budget_below_one_chunk_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match="holds no chunk"):
        DiskTier.open(DiskConfig(tmp_path, GEOMETRY.slot_bytes - 1), GEOMETRY, MODEL)


@pytest.mark.skipif(not CAN_MOUNT, reason="mounts ramfs: needs root and unshare")
def test_direct_io_falls_back_to_buffered_where_the_file_system_has_none(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out, err = worker("open", mnt, mount=f"mount -t ramfs ramfs {mnt}")
    assert out.strip() == "buffered"
    assert "takes no direct I/O" in err


def test_direct_io_is_used_where_the_file_system_has_it(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("tmp_path's file system takes no direct I/O")
    os.close(fd)
    with open_tier(tmp_path, 4) as tier:
        assert tier.io_method is IoMethod.DIRECT


def test_a_chunk_of_another_size_or_key_length_is_refused(tmp_path: Path) -> None:
    with open_tier(tmp_path, 4) as tier:
        with pytest.raises(ValueError, match="bytes, not"):
            tier.write([(key_of(0), [memoryview(np.zeros(10, np.uint8))])])
        with pytest.raises(ValueError, match="key has"):
            tier.read([(b"short", content(key_of(0)))])


def test_reads_racing_removals_and_writes_read_whole_chunks_and_leak_no_slot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Reads race removals and writes that reuse the freed slots at once: every read finds its
    chunk whole or not at all, none reads another chunk's bytes (which would fail its checksum
    and be logged), and a slot freed while a read had it is free again once the read is done."""
    # many small chunks: a read of them all takes many removals and writes
    big = ChunkGeometry(num_layers=1, layer_bytes=4096)
    pool = dict(chunks(range(640), big))  # made up front: a write follows its removal at once
    stop = threading.Event()
    reads: list[int] = []

    def reader(tier: DiskTier) -> None:
        while not stop.is_set():
            reads.append(len(read_back(tier, tier.keys(), big)))

    rng = random.Random(7)
    tier = open_tier(tmp_path, 512, big)
    with caplog.at_level(logging.WARNING), tier:
        tier.write(list(pool.items())[:512])
        threads = [threading.Thread(target=reader, args=(tier,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        written = 0
        deadline = time.monotonic() + 3
        try:
            while time.monotonic() < deadline:
                on_disk = tier.keys()  # fewer and fewer, while reads hold freed slots back
                tier.remove(rng.sample(on_disk, min(16, len(on_disk))))
                off_disk = [key for key in pool if key not in tier]
                # a slot freed while a read has it stays out of use: some writes find fewer
                written += len(tier.write([(key, pool[key]) for key in rng.sample(off_disk, 16)]))
        finally:  # the readers stop however the writes end (else the process never exits)
            stop.set()
            for thread in threads:
                thread.join()
        assert tier.num_free + tier.num_chunks == tier.num_slots  # none held back for good
    assert len(reads) > 10 and written > 100
    assert "read back torn" not in caplog.text


def test_a_failed_start_leaves_the_directory_free_for_the_next(tmp_path: Path) -> None:
    (tmp_path / "slots.bin").mkdir()
    with pytest.raises(DiskTierError, match="slots.bin"):
        open_tier(tmp_path, 4)
    (tmp_path / "slots.bin").rmdir()
    with open_tier(tmp_path, 4) as tier:
        assert tier.write(chunks(range(4))) == [key_of(n) for n in range(4)]
