"""`pensieve serve --http-port` in a subprocess for the end-to-end HTTP tests: a real server
process with its nats-server and accounts, tenants made by `pensieve tenant add`, the real
SmolLM2 on the CPU, and the official `openai` client made as a user makes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from openai import OpenAI

from pensieve.ops.nats_server import free_port

MODEL = "smollm2"


class Server:
    """`pensieve serve --http-port` in a subprocess."""

    def __init__(self, data_dir: Path, *options: str) -> None:
        """`options`: more of `pensieve serve`'s."""
        self.data_dir = data_dir
        self.http_port, self.nats_port = free_port(), free_port()
        command = [
            sys.executable,
            "-m",
            "pensieve.ops.cli",
            "serve",
            "--model",
            MODEL,
            "--data-dir",
            str(data_dir),
            "--nats-port",
            str(self.nats_port),
            "--http-port",
            str(self.http_port),
            "--gpu-cache-tokens",
            "256",
            "--cpu-cache-tokens",
            "256",
            "--admission-reserve",
            "0",
            "--log-level",
            "warning",
            *options,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            self.lines.append(line)
            if "OpenAI-compatible API on" in line:
                return
        raise AssertionError(f"the server did not start:\n{''.join(self.lines)}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def tenant(self, name: str) -> dict[str, Any]:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pensieve.ops.cli",
                "tenant",
                "add",
                name,
                "--data-dir",
                str(self.data_dir),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return dict(json.loads(done.stdout))

    def client(self, name: str) -> OpenAI:
        """The official client with the key of a new tenant `name`."""
        return client(self, self.tenant(name))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@contextmanager
def serving(data_dir: Path, *options: str) -> Iterator[Server]:
    """A server for the length of the block, which must stop cleanly."""
    running = Server(data_dir, *options)
    try:
        yield running
    finally:
        assert running.stop() == 0


def client(server: Server, tenant: dict[str, Any]) -> OpenAI:
    """The official client, as a user makes it from the line of `pensieve tenant add`."""
    return OpenAI(base_url=server.base_url, api_key=tenant["http"]["api_key"], max_retries=0)
