"""`pensieve serve`: the chat API on NATS, every actor in this process.

Starts a nats-server on loopback (port 4222 unless `--nats-port` says otherwise) unless
`--nats-url` names one, opens the LMDB store in `--data-dir`, loads the model, and answers
`pensieve.v1.chat` and `pensieve.v1.conversations.*` until SIGINT or SIGTERM. The nats-server
started here asks who connects (accounts under <data-dir>/nats; `pensieve tenant add` makes a
client's), unless `--insecure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from pensieve.actors.config import DEFAULT_EXPIRY, DEFAULTS, ExpiryConfig, StepChannel
from pensieve.actors.executor.actor import ExecutorActor
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.executor.spill_keeper import SpillKeeper
from pensieve.actors.ingress.actor import IngressActor
from pensieve.actors.ingress.http_actor import (
    Authenticate,
    HttpConfig,
    HttpIngressActor,
    serve_metrics,
)
from pensieve.actors.planner.actor import RecomputePlannerActor
from pensieve.actors.scheduler.actor import ChatServer, EngineThread
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.scheduler.remote_runner import connect_executor
from pensieve.actors.scheduler.sweeper import sweeping
from pensieve.actors.tokenizer.actor import tokenizer_replicas
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus, ConnectOptions
from pensieve.models.loader import LoadedModel
from pensieve.ops.api_keys import ApiKeys
from pensieve.ops.executor_ranks import ExecutorRanks, RankSpec
from pensieve.ops.factory import (
    Built,
    EngineOptions,
    assemble_remote,
    build,
    cpu_threads,
    freeze_start_up,
    frozen_heap,
    load_config_only,
)
from pensieve.ops.nats_auth import NatsAuth, redact_url
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.ops.ranks_engine import wait_ranks
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore, StoreWriter

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
    expiry: ExpiryConfig = DEFAULT_EXPIRY
    nats_auth: NatsAuth | None = None  # who the actors are to the server at `nats_url`
    events_auth: NatsAuth | None = None  # who the scheduler is to its system account there
    # the embedded server asks who connects: accounts and credentials under <this>/nats/
    auth_data_dir: Path | None = None
    http: HttpConfig | None = None  # the OpenAI-compatible HTTP ingress (None: none)
    api_keys_required: bool = True  # False: an HTTP request without a key is the service's
    metrics_port: int | None = None  # /metrics on a port of its own (None: none)
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError("--max-waiting must be >= 1")
        if self.shutdown_grace_s < 0:
            raise ValueError("--shutdown-grace must be >= 0")
        if self.tokenizers < 0:
            raise ValueError("--tokenizers must be >= 0 (0: tokenizer actors run elsewhere)")
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


@dataclass(frozen=True)
class Front:
    """What serves clients beside the NATS ingress: the HTTP ingress, and /metrics."""

    http: HttpConfig | None = None
    authenticate: Authenticate | None = None  # an HTTP request's API key -> its tenant
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


NO_FRONT = Front()  # the NATS ingress alone


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "pensieve"


@contextlib.asynccontextmanager
async def serving(
    built: Built,
    store: ConversationStore,
    nats_url: str,
    max_waiting: int = DEFAULTS.max_waiting,
    threads: int | None = None,
    shutdown_grace_s: float = DEFAULTS.shutdown_grace_s,
    step_channel: StepChannel = DEFAULTS.step_channel,
    tokenizers: int = DEFAULTS.tokenizers,
    expiry: ExpiryConfig = DEFAULT_EXPIRY,
    ingress: bool = True,
    planner: bool = True,
    connect: ConnectOptions | None = None,
    remote_text: bool | None = None,
    front: Front = NO_FRONT,
    events: ConnectOptions | None = None,
) -> AsyncIterator[ChatService]:
    """Serve the client API on `nats_url` while the context is open (with `ingress` False,
    only the scheduler's side of it: ingress actors run elsewhere; with `planner` False, the
    recompute planner runs elsewhere); every actor logs in to NATS as `connect` says (None:
    anonymously); a CPU engine steps on
    `threads` PyTorch threads, its model behind an executor actor with `StepChannel.NATS`.
    `tokenizers` replicas of the tokenizer actor render the chat templates. The reply tokens'
    text is found by the tokenizer actors over NATS where they run elsewhere (`tokenizers` 0),
    and on the engine thread, with the same core, where they would share this process (they
    would compete with the engine thread for the interpreter lock); `remote_text` True or False
    chooses. `front` adds the HTTP ingress (with `ingress`) and a /metrics port. Conversations idle
    past their TTL (`expiry`) are deleted. On leaving, turns in flight get `shutdown_grace_s` to
    finish; the rest are answered `unavailable`. With `events` (a user of the server's system
    account), a tenant's turns end when its connection closes (see `ChatServer`)."""
    with StoreWriter() as writer:
        engine_id = store.engine_id()

        def new_id() -> str:  # names this engine, so other engines forward its turns here
            return subjects.new_conversation_id(engine_id, secrets.token_hex(8))

        service = ChatService(
            built.engine,
            built.chat,
            built.loaded.config.max_context_len,
            store,
            writer,
            max_waiting,
            new_id,
        )
        async with contextlib.AsyncExitStack() as actors:
            # an engine around a remote executor (`pensieve actor scheduler`) starts none here
            # and keeps no spill index: the executor's swap manager does
            if isinstance(built.engine.runner, ModelRunner):
                if step_channel is StepChannel.NATS:
                    await actors.enter_async_context(
                        executor_actor(built, nats_url, engine_id, threads, connect, store)
                    )
                else:  # the model runs on the engine thread, which hands it the KV events
                    built.engine.follow_kv_events(SpillKeeper(store, writer).apply)
                    actors.callback(built.engine.follow_kv_events, None)
            await actors.enter_async_context(  # up before the ingress, down after it
                tokenizer_replicas(nats_url, engine_id, built.chat, tokenizers, connect)
            )
            if planner:
                block_size = built.engine.cache_config.block_size
                await actors.enter_async_context(
                    RecomputePlannerActor(
                        await Bus.connect(nats_url, options=connect), engine_id, store, block_size
                    )
                )
            text_remote = tokenizers == 0 if remote_text is None else remote_text
            async with _engine_serving(
                service,
                nats_url,
                engine_id,
                threads,
                shutdown_grace_s,
                expiry,
                ingress,
                connect,
                text_remote,
                front,
                events,
            ) as run:
                yield run


@contextlib.asynccontextmanager
async def executor_actor(
    built: Built,
    nats_url: str,
    engine_id: str,
    threads: int | None,
    connect: ConnectOptions | None = None,
    store: ConversationStore | None = None,
) -> AsyncIterator[None]:
    """The model behind an executor actor on the bus; the engine steps it through the
    per-step channel (`actors/scheduler/remote_runner.py`) until the context closes. With
    `store`, the actor keeps the spill index there."""
    runner = built.engine.runner
    if not isinstance(runner, ModelRunner):
        raise TypeError("the engine's model already runs elsewhere")
    async with ExecutorActor(
        await Bus.connect(nats_url, options=connect), engine_id, runner, threads, store
    ):
        bus = await Bus.connect(nats_url, options=connect)
        remote = await connect_executor(bus, engine_id, timeout_s=30)
        built.engine.runner = remote
        try:
            yield
        finally:
            built.engine.runner = runner
            await remote.close()
            await bus.close()


@contextlib.asynccontextmanager
async def _engine_serving(
    service: ChatService,
    nats_url: str,
    engine_id: str,
    threads: int | None,
    grace_s: float,
    expiry: ExpiryConfig,
    ingress: bool,
    connect: ConnectOptions | None,
    remote_text: bool,
    front: Front,
    events: ConnectOptions | None,
) -> AsyncIterator[ChatService]:
    engine = EngineThread(service, threads)
    watcher: Bus | None = None
    try:
        bus = await Bus.connect(nats_url, options=connect)
        if events is not None:
            watcher = await Bus.connect(nats_url, "pensieve-events", events)
        server = ChatServer(bus, engine, engine_id, remote_text, watcher)
        try:
            await server.start()
            async with contextlib.AsyncExitStack() as doors:
                if ingress:  # up after the scheduler, down before it
                    await doors.enter_async_context(
                        IngressActor(await Bus.connect(nats_url, options=connect), engine_id)
                    )
                if ingress and front.http is not None:
                    assert front.authenticate is not None, "the HTTP ingress needs its API keys"
                    http_bus = await Bus.connect(nats_url, "pensieve-http", connect)
                    # the model's context, which /v1/models tells (this process knows it)
                    http = replace(front.http, max_model_len=service.max_context)
                    await doors.enter_async_context(
                        HttpIngressActor(
                            http_bus,
                            engine_id,
                            http,
                            front.authenticate,
                            service.metrics.exposition,
                        )
                    )
                if front.metrics_port is not None:
                    await doors.enter_async_context(
                        serve_metrics(
                            front.metrics_host, front.metrics_port, service.metrics.exposition
                        )
                    )
                async with sweeping(engine, expiry):
                    yield service
            await server.drain(grace_s)
        finally:
            await bus.close()
            if watcher is not None:
                await watcher.close()
    finally:  # off the event loop: a step in hand may need it to reach the executor
        await asyncio.to_thread(engine.stop)


async def serve_until_signal(
    built: Built,
    store: ConversationStore,
    url: str,
    options: ServeOptions,
    started: float,
    ingress: bool = True,
    planner: bool = True,
    connect: ConnectOptions | None = None,
    events: ConnectOptions | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    threads = cpu_threads(built.options)
    keys = ApiKeys(options.data_dir, options.api_keys_required)
    front = Front(options.http, keys.tenant, options.metrics_port, options.metrics_host)
    async with serving(
        built,
        store,
        url,
        options.max_waiting,
        threads,
        options.shutdown_grace_s,
        options.step_channel,
        options.tokenizers,
        options.expiry,
        ingress,
        planner,
        connect,
        front=front,
        events=events,
    ):
        engine_id = store.engine_id()
        logger.info("ready in %.1f s", time.monotonic() - started)
        # the line clients and scripts wait for, whatever the log level
        if ingress:
            own = subjects.engine_subject(engine_id, ">")
            print(
                f"pensieve: serving on {redact_url(url)} (pensieve.v1.chat, "
                f"pensieve.v1.conversations.*; this engine: {own})",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"pensieve: scheduler of engine {engine_id} serving on {redact_url(url)}",
                file=sys.stderr,
                flush=True,
            )
        if ingress and options.http is not None:
            http = options.http
            print(
                f"pensieve: OpenAI-compatible API on http://{http.host}:{http.port}/v1 "
                f"(model {http.model!r}; /metrics, /health)",
                file=sys.stderr,
                flush=True,
            )
        if options.metrics_port is not None:
            print(
                f"pensieve: metrics on http://{front.metrics_host}:{options.metrics_port}/metrics",
                file=sys.stderr,
                flush=True,
            )
        await stop.wait()
        logger.info("stopping: up to %.0f s for the turns in flight", options.shutdown_grace_s)


def serve(engine_options: EngineOptions, options: ServeOptions, started: float) -> int:
    """Run `pensieve serve` until SIGINT or SIGTERM; `started` is the process's start time
    (time.monotonic()), for the start-up log."""
    provider = setup_tracing(options.trace)
    try:
        # the store holds every prompt and reply: readable by this user only
        options.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with ConversationStore(options.data_dir) as store, contextlib.ExitStack() as stack:
            url, auth, events = options.nats_url, options.nats_auth, options.events_auth
            if url is None:  # first, so a taken port fails before the model loads
                begin = time.monotonic()
                server = stack.enter_context(
                    EmbeddedNats(options.nats_port, auth_data_dir=options.auth_data_dir)
                )
                url, auth, events = server.url, server.service_auth, server.events_auth
                logger.info("nats-server listening on %s (%.1f s)", url, time.monotonic() - begin)
            connect = auth.connect_options() if auth is not None else None
            if engine_options.tensor_parallel > 1:  # the model runs in the ranks' processes
                spec = RankSpec(engine_options, url, options.data_dir, auth, options.trace)
                ranks = stack.enter_context(ExecutorRanks(spec))
                wait_ranks(ranks)
                loaded, chat = load_config_only(engine_options)
                watch = events.connect_options() if events is not None else None
                with frozen_heap():
                    asyncio.run(
                        _serve_ranks(
                            engine_options,
                            loaded,
                            chat,
                            store,
                            url,
                            options,
                            started,
                            connect,
                            watch,
                        )
                    )
                return 0
            built = build(engine_options)
            with frozen_heap():
                watch = events.connect_options() if events is not None else None
                asyncio.run(
                    serve_until_signal(
                        built, store, url, options, started, connect=connect, events=watch
                    )
                )
        return 0
    finally:
        if provider is not None:
            provider.shutdown()  # flush the spans still batched


async def _serve_ranks(
    engine_options: EngineOptions,
    loaded: LoadedModel,
    chat: ChatTokenizer,
    store: ConversationStore,
    url: str,
    options: ServeOptions,
    started: float,
    connect: ConnectOptions | None,
    events: ConnectOptions | None,
) -> None:
    """Serve with the model in tensor-parallel executor ranks: the engine steps them over the
    per-step channel, as a scheduler steps an executor actor of its own process."""
    bus = await Bus.connect(url, "pensieve-scheduler", connect)
    try:
        runner = await connect_executor(bus, store.engine_id(), timeout_s=60)
        try:
            built = assemble_remote(engine_options, loaded, chat, runner)
            freeze_start_up()
            await serve_until_signal(
                built, store, url, options, started, connect=connect, events=events
            )
        finally:
            await runner.close()
    finally:
        await bus.close()
