"""What every actor of a deployment starts from (`Context`): where NATS is and who to be there,
the store, the engine and serve options, and the engine of the process when it runs one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pensieve.actors.config import DEFAULT_EXPIRY, DEFAULTS, ExpiryConfig, StepChannel
from pensieve.actors.ingress.http_actor import HttpConfig
from pensieve.actors.ingress.placement import PlacementConfig
from pensieve.actors.scheduler.actor import ChatServer
from pensieve.actors.scheduler.remote_runner import connect_executor
from pensieve.actors.wire.bus import Bus, ConnectOptions
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import Built, assemble_remote, freeze_start_up, load_config_only
from pensieve.ops.nats_auth import NatsAuth, redact_url
from pensieve.store import ConversationStore

logger = logging.getLogger("pensieve")


@dataclass(frozen=True)
class ServeOptions:
    data_dir: Path
    nats_url: str | None = None  # None: start a nats-server of our own on `nats_port`
    nats_port: int = DEFAULTS.nats_port
    max_waiting: int = DEFAULTS.max_waiting
    trace: str = "none"
    shutdown_grace_s: float = DEFAULTS.shutdown_grace_s
    step_channel: StepChannel = DEFAULTS.step_channel
    tokenizers: int = DEFAULTS.tokenizers
    # the reply tokens' text found by the tokenizer actors over NATS (None: where they run
    # elsewhere, `tokenizers` 0; in this process they would compete with the engine thread for
    # the interpreter lock, so the engine thread finds it with the same core)
    remote_text: bool | None = None
    expiry: ExpiryConfig = DEFAULT_EXPIRY
    nats_auth: NatsAuth | None = None  # who the actors are to the server at `nats_url`
    events_auth: NatsAuth | None = None  # who the scheduler is to its system account there
    # the embedded server asks who connects: accounts and credentials under <this>/nats/
    auth_data_dir: Path | None = None
    http: HttpConfig | None = None  # the OpenAI-compatible HTTP ingress (None: none)
    api_keys_required: bool = True  # False: an HTTP request without a key is the service's
    metrics_port: int | None = None  # /metrics on a port of its own (None: none)
    metrics_host: str = "127.0.0.1"
    # committed turns also go to a replicated log on NATS JetStream, and the engine holds its
    # conversations through a lease (docs/many-engines.md); False: the local store alone
    turn_log: bool = False
    turn_log_replicas: int = 0  # 0: as many servers as the cluster has, at most 3
    lease_ttl_s: float = 2.0
    # where the ingress sends a turn that names no conversation (actors/ingress/placement.py)
    placement: PlacementConfig = PlacementConfig()

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError("--max-waiting must be >= 1")
        if self.shutdown_grace_s < 0:
            raise ValueError("--shutdown-grace must be >= 0")
        if self.tokenizers < 0:
            raise ValueError("--tokenizers must be >= 0 (0: tokenizer actors run elsewhere)")
        if self.turn_log_replicas < 0 or self.lease_ttl_s <= 0:
            raise ValueError("--turn-log-replicas must be >= 0 and --lease-ttl > 0")
        if self.turn_log and self.nats_url is None and self.auth_data_dir is not None:
            raise ValueError(
                "--turn-log jetstream with the embedded server's accounts is not supported: "
                "pass --nats-url to a server with JetStream, or --nats-auth none"
            )
        if not 0 < self.nats_port < 65536:
            raise ValueError(f"--nats-port must be a TCP port, got {self.nats_port}")
        for name, port in (
            ("--http-port", self.http and self.http.port),
            ("--metrics-port", self.metrics_port),
        ):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} must be a TCP port, got {port}")
        if self.http is not None and not self.api_keys_required and not _loopback(self.http.host):
            raise ValueError(
                "--insecure asks HTTP clients for no API key: serve HTTP on "
                "loopback only (--http-host 127.0.0.1)"
            )


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass(frozen=True)
class Nats:
    """Where the actors meet, and who they are there."""

    url: str
    connect: ConnectOptions | None = None  # None: anonymously
    # a user of the server's system account: the scheduler ends a tenant's turns when its
    # connection closes (see `ChatServer`); None: none
    events: ConnectOptions | None = None

    async def bus(self, name: str = "pensieve") -> Bus:
        return await Bus.connect(self.url, name, self.connect)

    def __str__(self) -> str:
        return redact_url(self.url)


@dataclass(frozen=True)
class Context:
    """What every entry of the table starts from."""

    nats: Nats
    store: ConversationStore  # names the engine every actor of it belongs to
    engine: EngineOptions
    serve: ServeOptions
    cpu_threads: int | None = None  # of the engine thread and the executor (None: torch's)
    # the engine of this process (`pensieve serve`, a scheduler's); None: it runs none, and an
    # executor loads its model runner itself
    built: Built | None = None
    # what the entries entered in this process started, by name, as they start
    running: dict[str, Any] = field(default_factory=dict)

    @property
    def engine_id(self) -> str:
        return self.store.engine_id()

    def scheduler(self) -> ChatServer | None:
        """The scheduler actor of this process, once it runs (None: it runs elsewhere)."""
        server = self.running.get("scheduler")
        return server if isinstance(server, ChatServer) else None

    def built_engine(self) -> Built:
        if self.built is None:
            raise ValueError("the scheduler needs the engine of its process (see remote_engine)")
        return self.built


@contextlib.asynccontextmanager
async def remote_engine(
    options: EngineOptions, nats: Nats, engine_id: str, timeout_s: float
) -> AsyncIterator[Built]:
    """An engine whose model runs in the executor actor (or tensor-parallel ranks) of engine
    `engine_id`, waited for up to `timeout_s`; this process loads only the model's config and
    tokenizer."""
    begin = time.monotonic()
    loaded, chat = load_config_only(options)
    logger.info("model config and tokenizer ready in %.1f s", time.monotonic() - begin)
    bus = await nats.bus("pensieve-scheduler")
    try:
        logger.info("waiting for the executor of engine %s", engine_id)
        runner = await connect_executor(bus, engine_id, timeout_s=timeout_s)
        try:
            built = assemble_remote(options, loaded, chat, runner)
            freeze_start_up()
            yield built
            # a clean stop: the executor writes the KV tiers back to its disk tier
            await asyncio.to_thread(write_back, built)
        finally:
            await runner.close()
    finally:
        await bus.close()


def write_back(built: Built) -> None:
    """After a clean stop (the turns in flight drained, no step in flight): the KV tiers'
    sealed chunks go to the disk tier, so the next start reads them back; a crash loses them.
    (Not on the event loop: over the bus the engine waits for the executor's answer.)"""
    disk = built.engine.disk
    if disk is None:
        return
    logger.info("disk tier: writing the KV tiers back")
    begin = time.monotonic()
    held = built.engine.write_back()
    logger.info("disk tier: %d chunks written back in %.1f s", held, time.monotonic() - begin)
    disk.close()
