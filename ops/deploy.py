"""Every actor of an engine, by the name `pensieve actor NAME` takes, and how it starts.

One table, `ACTORS`, maps each actor's name to its entry point: a function that builds the
actor, as an async context manager, from one `Context` (where NATS is and who to be there, the
store, the engine and serve options, and the engine of this process when it runs one). Every
deployment is a list of entries entered in order and left in reverse:

    pensieve actor NAME   ACTORS[NAME] (the scheduler with its --tokenizers and /metrics port)
    pensieve serve        executor, tokenizer, recompute-planner, scheduler, ingress, http,
                          metrics: each is up before whatever sends to it, and down after

compose.yaml runs one `pensieve actor NAME` service per entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from pensieve.actors.config import StepChannel
from pensieve.actors.executor.actor import ExecutorActor
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.executor.spill_keeper import SpillKeeper
from pensieve.actors.ingress.actor import IngressActor
from pensieve.actors.ingress.http_actor import HttpConfig, HttpIngressActor, serve_metrics
from pensieve.actors.ingress.placement import PromptKeys
from pensieve.actors.planner.actor import RecomputePlannerActor
from pensieve.actors.scheduler.actor import ChatServer
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.scheduler.ownership import Ownership
from pensieve.actors.scheduler.remote_runner import connect_executor
from pensieve.actors.tokenizer.actor import tokenizer_replicas
from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.jetstream import JetStream, cluster_size
from pensieve.ops.api_keys import ApiKeys
from pensieve.ops.context import Context, ServeOptions
from pensieve.ops.factory import build_runner, freeze_start_up, load_config_only, model_identity
from pensieve.store import StoreWriter

logger = logging.getLogger("pensieve")


Start = Callable[[Context], AbstractAsyncContextManager[Any]]


@dataclass(frozen=True)
class Entry:
    """One actor's entry point: `start(context)` is the actor while the context is open."""

    name: str
    start: Start
    ready: Callable[[Context], str]  # the line `pensieve actor` prints once it serves


@contextlib.asynccontextmanager
async def deployment(ctx: Context, entries: Sequence[Entry]) -> AsyncIterator[Context]:
    """`entries` started in order (each recorded in `ctx.running`), stopped in reverse."""
    async with contextlib.AsyncExitStack() as stack:
        for entry in entries:
            ctx.running[entry.name] = await stack.enter_async_context(entry.start(ctx))
            stack.callback(ctx.running.pop, entry.name, None)
        yield ctx


async def until_signal(
    ctx: Context, entries: Sequence[Entry], announce: Callable[[], None]
) -> None:
    """Run `entries` until SIGINT or SIGTERM (one during the start stops them once they are
    up); `announce` tells the world once they serve."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with deployment(ctx, entries):
        announce()
        await stop.wait()
        logger.info("stopping: up to %.0f s for the turns in flight", ctx.serve.shutdown_grace_s)


# ---- the entries -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _executor(ctx: Context) -> AsyncIterator[ExecutorActor | None]:
    """The model runner behind an executor actor; beside the scheduler, the per-step channel
    chooses whether the engine steps it over NATS or on its own thread."""
    if ctx.built is None:  # a process of its own: the model runner and its swap manager alone
        runner = build_runner(ctx.engine)
        freeze_start_up()
        bus = await ctx.nats.bus()
        try:
            async with ExecutorActor(bus, ctx.engine_id, runner, ctx.cpu_threads, ctx.store) as a:
                yield a
        finally:  # what was saved is written, and the directory let go
            if runner.disk is not None:
                await asyncio.to_thread(runner.disk.close)
        return
    engine = ctx.built.engine
    runner = engine.runner
    if not isinstance(runner, ModelRunner):  # in tensor-parallel ranks: they keep the index
        yield None
    elif ctx.serve.step_channel is StepChannel.NATS:
        async with _executor_beside(ctx, runner) as actor:
            yield actor
    else:  # the model runs on the engine thread, which hands its KV events to the spill index
        with StoreWriter("pensieve-spill-index") as writer:
            engine.follow_kv_events(SpillKeeper(ctx.store, writer).apply)
            try:
                yield None
            finally:
                engine.follow_kv_events(None)


@contextlib.asynccontextmanager
async def _executor_beside(ctx: Context, runner: ModelRunner) -> AsyncIterator[ExecutorActor]:
    """The engine's own model behind an executor actor; the engine steps it (and asks its disk
    tier) through the per-step channel (`actors/wire/step_codec.py`) while the context is
    open."""
    engine = ctx.built_engine().engine
    disk = engine.disk
    bus = await ctx.nats.bus()
    async with ExecutorActor(bus, ctx.engine_id, runner, ctx.cpu_threads, ctx.store) as actor:
        channel = await ctx.nats.bus()
        remote = await connect_executor(channel, ctx.engine_id, timeout_s=30)
        engine.runner = remote
        if disk is not None:
            engine.disk = remote.disk
        try:
            yield actor
        finally:
            engine.runner, engine.disk = runner, disk
            await remote.close()
            await channel.close()


@contextlib.asynccontextmanager
async def _tokenizers(ctx: Context) -> AsyncIterator[list[Any]]:
    """`--tokenizers` replicas (at least one) of the tokenizer actor."""
    if ctx.built is not None:
        chat = ctx.built.chat
    else:  # the tokenizer alone
        _, chat = load_config_only(ctx.engine)
        freeze_start_up()
    replicas = max(1, ctx.serve.tokenizers)
    nats = ctx.nats
    async with tokenizer_replicas(nats.url, ctx.engine_id, chat, replicas, nats.connect) as started:
        yield started


@contextlib.asynccontextmanager
async def _recompute_planner(ctx: Context) -> AsyncIterator[RecomputePlannerActor]:
    bus = await ctx.nats.bus()
    async with RecomputePlannerActor(bus, ctx.engine_id, ctx.store, ctx.engine.block_size) as a:
        yield a


@contextlib.asynccontextmanager
async def _scheduler(ctx: Context) -> AsyncIterator[ChatServer]:
    """The scheduler actor around the engine of this process, with its store writer."""
    built, serve = ctx.built_engine(), ctx.serve
    engine_id = ctx.engine_id

    def new_id() -> str:  # names this engine, so other engines forward its turns here
        return subjects.new_conversation_id(engine_id, secrets.token_hex(8))

    with StoreWriter() as writer:
        max_context = built.engine.max_model_len
        model = built.options.model if serve.http is None else serve.http.model
        service = ChatService(
            built.engine,
            built.chat,
            max_context,
            ctx.store,
            writer,
            serve.max_waiting,
            new_id,
            model=model,
        )
        remote_text = serve.tokenizers == 0 if serve.remote_text is None else serve.remote_text
        events = None
        if ctx.nats.events is not None:
            events = await Bus.connect(ctx.nats.url, "pensieve-events", ctx.nats.events)
        try:
            bus = await ctx.nats.bus()
        except BaseException:
            if events is not None:
                await events.close()
            raise
        server = ChatServer(
            bus,
            engine_id,
            service,
            cpu_threads=ctx.cpu_threads,
            remote_text=remote_text,
            events=events,  # closed by the actor
            expiry=serve.expiry,
            grace_s=serve.shutdown_grace_s,
            ownership=_ownership(ctx, bus, writer),
        )
        async with server:
            yield server


def _ownership(ctx: Context, bus: Bus, writer: StoreWriter) -> Ownership | None:
    """With the turn log on: the engine's lease and held conversations over `bus`."""
    serve = ctx.serve
    if not serve.turn_log:
        return None
    replicas = serve.turn_log_replicas or min(3, cluster_size(bus))
    js = JetStream(bus)
    return Ownership(js, ctx.engine_id, ctx.store, writer, serve.lease_ttl_s, replicas)


@contextlib.asynccontextmanager
async def _ingress(ctx: Context) -> AsyncIterator[IngressActor]:
    bus = await ctx.nats.bus()
    jetstream = JetStream(bus) if ctx.serve.turn_log else None
    # keyed as this engine keys its chunks (public prompts: known where the engine runs)
    public = ctx.built.engine.public if ctx.built is not None else None
    keys = PromptKeys(model_identity(ctx.engine), ctx.engine.block_size, public)
    async with IngressActor(bus, ctx.engine_id, jetstream, ctx.serve.placement, keys) as actor:
        yield actor


@contextlib.asynccontextmanager
async def _http(ctx: Context) -> AsyncIterator[HttpIngressActor]:
    """The HTTP ingress; beside the scheduler, its /metrics and /v1/models read the scheduler
    of this process, elsewhere they ask over the bus."""
    config = _http_config(ctx)
    keys = ApiKeys(ctx.serve.data_dir, ctx.serve.api_keys_required)
    server, metrics = ctx.scheduler(), None
    if server is not None:
        config = dataclasses.replace(config, max_model_len=server.service.max_context)
        metrics = server.service.metrics.exposition
    bus = await ctx.nats.bus("pensieve-http")
    async with HttpIngressActor(bus, ctx.engine_id, config, keys.tenant, metrics) as actor:
        yield actor


@contextlib.asynccontextmanager
async def _metrics(ctx: Context) -> AsyncIterator[None]:
    """`GET /metrics` of the scheduler of this process on `--metrics-port`."""
    server, port = ctx.scheduler(), ctx.serve.metrics_port
    if server is None or port is None:
        raise ValueError("a metrics port serves the scheduler of its own process")
    async with serve_metrics(ctx.serve.metrics_host, port, server.service.metrics.exposition):
        yield


def _ready(what: str, tail: str = "") -> Callable[[Context], str]:
    return lambda ctx: f"pensieve: {what} of engine {ctx.engine_id} ready on {ctx.nats}{tail}"


def _tokenizers_ready(ctx: Context) -> str:
    replicas = max(1, ctx.serve.tokenizers)
    return _ready(f"{replicas} tokenizer replica(s)")(ctx)


def _scheduler_ready(ctx: Context) -> str:
    return f"pensieve: scheduler of engine {ctx.engine_id} serving on {ctx.nats}"


def _http_config(ctx: Context) -> HttpConfig:
    if ctx.serve.http is None:
        raise ValueError("the HTTP ingress needs a port (--http-port)")
    return ctx.serve.http


def _http_ready(ctx: Context) -> str:
    http = _http_config(ctx)
    return (
        f"pensieve: HTTP ingress of engine {ctx.engine_id} ready on http://{http.host}:"
        f"{http.port}/v1 (model {http.model!r})"
    )


def _metrics_ready(ctx: Context) -> str:
    return f"pensieve: metrics on http://{ctx.serve.metrics_host}:{ctx.serve.metrics_port}/metrics"


API = " (pensieve.v1.chat, pensieve.v1.conversations.*)"
# every actor of an engine, by the name `pensieve actor NAME` runs it under
ACTORS: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry("ingress", _ingress, _ready("ingress", API)),
        Entry("http", _http, _http_ready),
        Entry("tokenizer", _tokenizers, _tokenizers_ready),
        Entry("scheduler", _scheduler, _scheduler_ready),
        Entry("recompute-planner", _recompute_planner, _ready("recompute planner")),
        Entry("executor", _executor, _ready("executor")),
    )
}
# not an actor: the scheduler's metrics on a port of their own, beside it
METRICS = Entry("metrics", _metrics, _metrics_ready)


def serve_plan(serve: ServeOptions) -> list[Entry]:
    """What `pensieve serve` runs in its process, in the order it starts them."""
    names = ["executor", "tokenizer", "recompute-planner", "scheduler", "ingress", "http"]
    return _with_metrics(serve, [ACTORS[name] for name in names if _wanted(name, serve)])


def actor_plan(name: str, serve: ServeOptions) -> list[Entry]:
    """What `pensieve actor NAME` runs: the actor, and beside a scheduler its tokenizer
    replicas (`--tokenizers`, 0: none) and its metrics port."""
    if name not in ACTORS:
        raise ValueError(f"unknown actor {name!r}; one of {', '.join(ACTORS)}")
    if name != "scheduler":
        return [ACTORS[name]]
    names = ("tokenizer", "scheduler")
    return _with_metrics(serve, [ACTORS[n] for n in names if _wanted(n, serve)])


def check_ports(plan: Sequence[Entry], serve: ServeOptions) -> None:
    """OSError naming the option, before anything loads, if a port that `plan` (or the
    nats-server that `serve` starts) would listen on is taken or named twice."""
    from pensieve.ops.nats_server import check_port_free, port_taken

    if serve.nats_url is None:
        check_port_free(serve.nats_port)
    names = {entry.name for entry in plan}
    ports = []
    if "http" in names and serve.http is not None:
        ports.append(("--http-port", serve.http.host, serve.http.port))
    if METRICS.name in names and serve.metrics_port is not None:
        ports.append(("--metrics-port", serve.metrics_host, serve.metrics_port))
    if serve.nats_url is None:
        ports.append(("--nats-port", "127.0.0.1", serve.nats_port))
    for i, (flag, _, port) in enumerate(ports):
        for other, _, same in ports[i + 1 :]:
            if port == same:
                raise ValueError(f"{flag} and {other} name one port, {port}: give each its own")
    for flag, host, port in ports:
        if flag != "--nats-port" and port_taken(port, host):
            raise OSError(
                f"{flag} {port}: the port is taken on {host} (another `pensieve serve`, or "
                f"another server?): pass another {flag}"
            )


def _wanted(name: str, serve: ServeOptions) -> bool:
    if name == "tokenizer":
        return serve.tokenizers > 0
    if name == "http":
        return serve.http is not None
    return True


def _with_metrics(serve: ServeOptions, entries: list[Entry]) -> list[Entry]:
    return entries + ([METRICS] if serve.metrics_port is not None else [])
