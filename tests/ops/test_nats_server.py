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
