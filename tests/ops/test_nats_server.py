"""The embedded nats-server's lifetime: it goes with the process that started it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

CHILD = """
import time
from pensieve.ops.nats_server import EmbeddedNats
with EmbeddedNats() as server:
    print(server.port, flush=True)
    time.sleep(120)
"""


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_killed_process_leaves_no_nats_server_behind() -> None:
    """SIGKILL gives the process no chance to stop its server; the kernel's parent-death signal
    does it, so the port is free again and no server lingers."""
    parent = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        port = int(parent.stdout.readline())
        assert _listening(port), "the server never listened"
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _listening(port), "nats-server outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()


ENGINE_PARENT = """
import sys, time
from pathlib import Path
from pensieve.ops.engine_process import EngineProcess
engine = EngineProcess(sys.argv[1], Path(sys.argv[2]), ["--model", "smollm2", "--cpu-threads",
    "1", "--tokenizers", "1"])
engine.wait_ready()
print(engine.proc.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_killed_benchmark_leaves_no_engine_behind(tmp_path) -> None:
    """An engine started with `EngineProcess` (the many-engine tests and benchmarks) stops when
    the process that started it is killed: SIGTERM from the kernel, then its own drain."""
    from pensieve.ops.nats_server import EmbeddedNats

    with EmbeddedNats() as server:
        argv = [sys.executable, "-c", ENGINE_PARENT, server.url, str(tmp_path / "engine")]
        parent = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            assert parent.stdout is not None
            engine = int(parent.stdout.readline())
            parent.kill()
            parent.wait(timeout=10)
            deadline = time.monotonic() + 60
            while _alive(engine) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not _alive(engine), "the engine outlived the process that started it"
        finally:
            if parent.poll() is None:
                parent.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
