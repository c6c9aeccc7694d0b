"""`pensieve actor NAME`: one actor of an engine in this process, meeting the others on a NATS
server (`--nats-url`); each takes the model, cache and store options of `pensieve serve`, so one
option list starts any of them, and each waits for the others rather than failing when it starts
first. The engine is named by the store in `--data-dir`: give every actor of one engine the same.

- `executor`: loads the model and holds the KV tiers (the swap manager lives here too); runs the
  step plans it is sent, and keeps the CPU tier's spill index in the store.
- `scheduler`: admission, batching and KV accounting, with `--tokenizers` tokenizer replicas
  (0: none here); loads only the model's config and tokenizer, and steps the executor over the
  bus.
- `recompute-planner`: follows the engine's KV events and, for a turn whose history was
  dropped, reads its tokens from the store and says which positions to recompute.
- `ingress`: the client API (`pensieve.v1.*`); checks each request and hands it to the
  scheduler, which answers the client directly. Run as many as you like.
- `http`: the OpenAI-compatible HTTP API (`--http-port`, default 8000), in front of the
  ingress; API keys from `--data-dir` (`pensieve tenant add`); its `/metrics` asks the
  scheduler over the bus.
- `tokenizer`: `--tokenizers` replicas of the tokenizer actor (at least one); loads only the
  tokenizer.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass

from pensieve.actors.executor.actor import ExecutorActor
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.ingress.actor import IngressActor
from pensieve.actors.ingress.http_actor import HttpIngressActor
from pensieve.actors.planner.actor import RecomputePlannerActor
from pensieve.actors.scheduler.remote_runner import connect_executor
from pensieve.actors.tokenizer.actor import tokenizer_replicas
from pensieve.actors.wire.bus import Bus, ConnectOptions
from pensieve.ops.api_keys import ApiKeys
from pensieve.ops.executor_ranks import ExecutorRanks, RankSpec
from pensieve.ops.factory import (
    EngineOptions,
    assemble_remote,
    build,
    cpu_threads,
    freeze_start_up,
    frozen_heap,
    load_config_only,
)
from pensieve.ops.nats_auth import redact_url
from pensieve.ops.serve import ServeOptions, serve_until_signal
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore

logger = logging.getLogger("pensieve")

ACTOR_COMMANDS = ("ingress", "http", "tokenizer", "scheduler", "recompute-planner", "executor")


def run_actor(name: str, engine: EngineOptions, options: ServeOptions, started: float) -> int:
    """Run actor `name` until SIGINT or SIGTERM."""
    if options.nats_url is None:
        raise ValueError("pensieve actor needs --nats-url: the actors of an engine meet there")
    if name not in ACTOR_COMMANDS:
        raise ValueError(f"unknown actor {name!r}; one of {', '.join(ACTOR_COMMANDS)}")
    nats = _Nats(options.nats_url, options.nats_auth and options.nats_auth.connect_options())
    provider = setup_tracing(options.trace)
    try:
        options.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with ConversationStore(options.data_dir) as store:
            if name == "executor" and engine.tensor_parallel > 1:
                return _executor_ranks(engine, options)
            # every actor's start-up heap (imports, and the model or tokenizer it loads) stays
            # out of the garbage collections made while it serves: a full one would stall it
            if name == "executor":
                built = build(engine)
                with frozen_heap():
                    asyncio.run(_executor(built.engine.runner, nats, store, cpu_threads(engine)))
            elif name == "recompute-planner":
                with frozen_heap():
                    asyncio.run(_planner(nats, store, engine.block_size))
            elif name == "ingress":
                with frozen_heap():
                    asyncio.run(_ingress(nats, store.engine_id()))
            elif name == "http":
                with frozen_heap():
                    asyncio.run(_http(nats, store.engine_id(), options))
            elif name == "tokenizer":
                with frozen_heap():
                    asyncio.run(
                        _tokenizer(engine, nats, store.engine_id(), max(1, options.tokenizers))
                    )
            else:
                with frozen_heap():
                    asyncio.run(_scheduler(engine, options, nats, store, started))
        return 0
    finally:
        if provider is not None:
            provider.shutdown()


@dataclass(frozen=True)
class _Nats:
    """Where the actors meet, and who this one is there."""

    url: str
    connect: ConnectOptions | None

    async def bus(self, name: str = "pensieve") -> Bus:
        return await Bus.connect(self.url, name, self.connect)

    def __str__(self) -> str:
        return redact_url(self.url)


def _on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _executor(
    runner: object, nats: _Nats, store: ConversationStore, threads: int | None
) -> None:
    assert isinstance(runner, ModelRunner)
    stop = _on_signals()
    engine_id = store.engine_id()
    async with ExecutorActor(await nats.bus(), engine_id, runner, threads, store):
        print(
            f"pensieve: executor of engine {engine_id} ready on {nats}", file=sys.stderr, flush=True
        )
        await stop.wait()


def _executor_ranks(engine: EngineOptions, options: ServeOptions) -> int:
    """The executor as `engine.tensor_parallel` rank processes until SIGINT or SIGTERM; 1 if
    they could not start."""
    assert options.nats_url is not None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    spec = RankSpec(engine, options.nats_url, options.data_dir, options.nats_auth, options.trace)
    with ExecutorRanks(spec) as ranks:
        while ranks.running and not stop.wait(0.5):
            pass
        if ranks.failed is not None:
            print(f"pensieve: error: {ranks.failed}", file=sys.stderr, flush=True)
            return 1
    return 0


async def _ingress(nats: _Nats, engine_id: str) -> None:
    stop = _on_signals()
    async with IngressActor(await nats.bus(), engine_id):
        print(
            f"pensieve: ingress of engine {engine_id} ready on {nats} (pensieve.v1.chat, "
            "pensieve.v1.conversations.*)",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()


async def _http(nats: _Nats, engine_id: str, options: ServeOptions) -> None:
    assert options.http is not None  # the command line gives it a port
    stop = _on_signals()
    keys = ApiKeys(options.data_dir, options.api_keys_required)
    http = options.http
    async with HttpIngressActor(await nats.bus("pensieve-http"), engine_id, http, keys.tenant):
        print(
            f"pensieve: HTTP ingress of engine {engine_id} ready on http://{http.host}:"
            f"{http.port}/v1 (model {http.model!r})",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()


async def _planner(nats: _Nats, store: ConversationStore, block_size: int) -> None:
    stop = _on_signals()
    engine_id = store.engine_id()
    async with RecomputePlannerActor(await nats.bus(), engine_id, store, block_size):
        print(
            f"pensieve: recompute planner of engine {engine_id} ready on {nats}",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()


async def _tokenizer(engine: EngineOptions, nats: _Nats, engine_id: str, replicas: int) -> None:
    _, chat = load_config_only(engine)
    freeze_start_up()
    stop = _on_signals()
    async with tokenizer_replicas(nats.url, engine_id, chat, replicas, nats.connect):
        print(
            f"pensieve: {replicas} tokenizer replica(s) of engine {engine_id} ready on {nats}",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()


async def _scheduler(
    engine: EngineOptions,
    options: ServeOptions,
    nats: _Nats,
    store: ConversationStore,
    started: float,
) -> None:
    begin = time.monotonic()
    loaded, chat = load_config_only(engine)
    logger.info("model config and tokenizer ready in %.1f s", time.monotonic() - begin)
    bus = await nats.bus()
    try:
        logger.info("waiting for the executor of engine %s", store.engine_id())
        runner = await connect_executor(bus, store.engine_id(), timeout_s=24 * 3600)
        try:
            built = assemble_remote(engine, loaded, chat, runner)
            freeze_start_up()
            events = options.events_auth and options.events_auth.connect_options()
            await serve_until_signal(
                built,
                store,
                nats.url,
                options,
                started,
                ingress=False,
                planner=False,
                connect=nats.connect,
                events=events,
            )
        finally:
            await runner.close()
    finally:
        await bus.close()
