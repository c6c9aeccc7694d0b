"""Helpers of the many-engine tests: a 3-node nats-server cluster with JetStream on loopback
ports, and `pensieve serve` engines in processes of their own on it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nats

from pensieve.ops.nats_server import find_binary, free_port


class NatsNode:
    def __init__(self, name: str, folder: Path, port: int, route: int, routes: list[int]) -> None:
        self.name = name
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"
        self.log = (folder / f"{name}.log").open("wb")
        others = ",".join(f"nats://127.0.0.1:{r}" for r in routes)
        command = [
            find_binary(),
            *("-a", "127.0.0.1", "-p", str(port), "-n", name),
            *("-js", "-sd", str(folder / name)),
            *("--cluster_name", "pensieve", "--cluster", f"nats://127.0.0.1:{route}"),
            *("--routes", others),
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class NatsCluster:
    """Three nats-servers routed to each other, JetStream on each; ready once JetStream
    answers (its meta leader is elected)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        ports = [free_port() for _ in range(3)]
        routes = [free_port() for _ in range(3)]
        self.nodes = [
            NatsNode(f"n{i}", folder, ports[i], routes[i], routes[:i] + routes[i + 1 :])
            for i in range(3)
        ]
        self.urls = [node.url for node in self.nodes]

    def __enter__(self) -> NatsCluster:
        asyncio.run(self._ready())
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.stop()

    async def _ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                client = await nats.connect(
                    self.urls, connect_timeout=1, error_cb=_quiet, max_reconnect_attempts=0
                )
                try:
                    await client.jetstream().account_info()
                    return
                finally:
                    await client.close()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


async def _quiet(error: Exception) -> None:
    pass


ENGINE_OPTIONS = ["--model", "smollm2", "--cpu-threads", "1", "--tokenizers", "1"]
_ENGINE_ID = re.compile(r"this engine: pensieve\.v1\.engine\.([0-9a-f]{8})\.")


class EngineProcess:
    """`pensieve serve` with the turn log on JetStream, on one node of the cluster."""

    def __init__(self, url: str, data_dir: Path, *extra: str) -> None:
        command = [
            sys.executable,
            *("-m", "pensieve.ops.cli", "serve", *ENGINE_OPTIONS),
            *("--nats-url", url, "--data-dir", str(data_dir)),
            *("--turn-log", "jetstream", "--lease-ttl", "2"),
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.data_dir = data_dir
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.engine_id = ""
        self._ready = threading.Event()
        # read all along: a pipe nobody reads fills up and blocks the engine's log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.lines.append(line)
            found = _ENGINE_ID.search(line)
            if found and not self._ready.is_set():
                self.engine_id = found.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 180.0) -> str:
        if not self._ready.wait(timeout) or not self.engine_id:
            raise AssertionError("engine not ready:\n" + "".join(self.lines[-40:]))
        return self.engine_id

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return "".join(self.lines[-60:])
