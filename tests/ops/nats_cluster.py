"""Helpers of the many-engine tests: a 3-node nats-server cluster with JetStream on loopback
ports, and `pensieve serve` engines in processes of their own on it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import nats

from pensieve.ops import engine_process as ops_engine
from pensieve.ops.nats_auth import SERVICE_ACCOUNT, SERVICE_USER
from pensieve.ops.nats_config import ServerConfig
from pensieve.ops.nats_server import find_binary, free_port


class NatsNode:
    def __init__(
        self,
        name: str,
        folder: Path,
        port: int,
        route: int,
        routes: list[int],
        accounts: ServerConfig | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"
        self.log = (folder / f"{name}.log").open("wb")
        others = [f"nats://127.0.0.1:{r}" for r in routes]
        if accounts is None:
            command = [
                find_binary(),
                *("-a", "127.0.0.1", "-p", str(port), "-n", name),
                *("-js", "-sd", str(folder / name)),
                *("--cluster_name", "pensieve", "--cluster", f"nats://127.0.0.1:{route}"),
                *("--routes", ",".join(others)),
            ]
        else:  # the accounts' configuration, on this node, with JetStream for the service
            config = json.loads(accounts.text())
            config["accounts"][SERVICE_ACCOUNT]["jetstream"] = "enabled"
            config.update(
                listen=f"127.0.0.1:{port}",
                server_name=name,
                jetstream={"store_dir": str(folder / name)},
                cluster={"name": "pensieve", "listen": f"127.0.0.1:{route}", "routes": others},
            )
            path = folder / f"{name}.conf"
            path.write_text(json.dumps(config))
            command = [find_binary(), "-c", str(path)]
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
    answers (its meta leader is elected). With `accounts`, every node runs that configuration
    (tenants and the service; JetStream for the service's account), and `service` holds the
    keyword arguments of `nats.connect` for the service's user."""

    def __init__(self, folder: Path, accounts: ServerConfig | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        ports = [free_port() for _ in range(3)]
        routes = [free_port() for _ in range(3)]
        self.nodes = [
            NatsNode(f"n{i}", folder, ports[i], routes[i], routes[:i] + routes[i + 1 :], accounts)
            for i in range(3)
        ]
        self.urls = [node.url for node in self.nodes]
        self.service: dict[str, str] = {}
        if accounts is not None:
            self.service = {"user": SERVICE_USER, "password": accounts.service_password}

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
                    self.urls,
                    connect_timeout=1,
                    error_cb=_quiet,
                    max_reconnect_attempts=0,
                    **self.service,  # type: ignore[arg-type]
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


class EngineProcess(ops_engine.EngineProcess):
    """`pensieve serve` with the turn log on JetStream, on one node of the cluster."""

    def __init__(self, url: str, data_dir: Path, *extra: str) -> None:
        turn_log = ("--turn-log", "jetstream", "--lease-ttl", "2")
        super().__init__(url, data_dir, [*ENGINE_OPTIONS, *turn_log, *extra])
