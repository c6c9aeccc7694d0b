"""`pensieve serve`: the chat API on NATS, every actor in this process.

Starts a nats-server on loopback (port 4222 unless `--nats-port` says otherwise) unless
`--nats-url` names one, opens the LMDB store in `--data-dir`, loads the model, and answers
`pensieve.v1.chat` and `pensieve.v1.conversations.*` until SIGINT or SIGTERM. The nats-server
started here asks who connects (accounts under <data-dir>/nats; `pensieve tenant add` makes a
client's), unless `--insecure`. The actors it runs, and their order, are `ops/deploy.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pensieve.actors.wire import subjects
from pensieve.ops.context import Context, Nats, ServeOptions, remote_engine, write_back
from pensieve.ops.deploy import check_ports, serve_plan, until_signal
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.executor_ranks import ExecutorRanks, RankSpec
from pensieve.ops.factory import build, cpu_threads, frozen_heap
from pensieve.ops.nats_auth import NatsAuth
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.ops.ranks_engine import wait_ranks
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore

logger = logging.getLogger("pensieve")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "pensieve"


def serve(engine_options: EngineOptions, options: ServeOptions, started: float) -> int:
    """Run `pensieve serve` until SIGINT or SIGTERM; `started` is the process's start time
    (time.monotonic()), for the start-up log. A taken port fails before the model loads, and a
    model that does not load leaves nothing behind: the data dir, the store and the nats-server
    (with its files and pid file) come after it."""
    plan = serve_plan(options)
    check_ports(plan, options)
    provider = setup_tracing(options.trace)
    try:
        if engine_options.tensor_parallel > 1:  # the model loads in the ranks' processes
            return _serve_split(engine_options, options, started)
        built = build(engine_options)
        with _started(options) as (store, nats, _):
            context = Context(
                nats, store, engine_options, options, cpu_threads(engine_options), built
            )
            with frozen_heap():
                asyncio.run(until_signal(context, plan, lambda: _announce(context, started)))
            write_back(built)
        return 0
    finally:
        if provider is not None:
            provider.shutdown()  # flush the spans still batched


def _serve_split(engine_options: EngineOptions, options: ServeOptions, started: float) -> int:
    """Serve with the model split over tensor-parallel executor rank processes."""
    with _started(options) as (store, nats, auth), contextlib.ExitStack() as stack:
        spec = RankSpec(engine_options, nats.url, options.data_dir, auth, options.trace)
        wait_ranks(stack.enter_context(ExecutorRanks(spec)))
        with frozen_heap():
            asyncio.run(_serve_ranks(engine_options, options, nats, store, started))
    return 0


@contextlib.contextmanager
def _started(options: ServeOptions) -> Iterator[tuple[ConversationStore, Nats, NatsAuth | None]]:
    """The store in the data dir, and NATS: the nats-server started here unless `--nats-url`;
    with who the service is there."""
    # the store holds every prompt and reply: readable by this user only
    options.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with ConversationStore(options.data_dir) as store, contextlib.ExitStack() as stack:
        url, auth, events = options.nats_url, options.nats_auth, options.events_auth
        if url is None:
            begin = time.monotonic()
            # with the turn log on, JetStream keeps its files beside the store's
            jetstream = options.data_dir / "jetstream" if options.turn_log else None
            server = stack.enter_context(
                EmbeddedNats(
                    options.nats_port,
                    auth_data_dir=options.auth_data_dir,
                    jetstream_dir=jetstream,
                )
            )
            url, auth, events = server.url, server.service_auth, server.events_auth
            logger.info("nats-server listening on %s (%.1f s)", url, time.monotonic() - begin)
        nats = Nats(
            url,
            auth.connect_options() if auth is not None else None,
            events.connect_options() if events is not None else None,
        )
        yield store, nats, auth


async def _serve_ranks(
    engine_options: EngineOptions,
    options: ServeOptions,
    nats: Nats,
    store: ConversationStore,
    started: float,
) -> None:
    """Serve with the model in tensor-parallel executor ranks: the engine steps them over the
    per-step channel, as a scheduler steps an executor actor of its own process."""
    async with remote_engine(engine_options, nats, store.engine_id(), timeout_s=60) as built:
        threads = cpu_threads(engine_options)
        context = Context(nats, store, engine_options, options, threads, built)
        await until_signal(context, serve_plan(options), lambda: _announce(context, started))


def _announce(context: Context, started: float) -> None:
    """The lines clients and scripts wait for, whatever the log level."""
    logger.info("ready in %.1f s", time.monotonic() - started)
    own = subjects.engine_subject(context.engine_id, ">")
    _say(
        f"pensieve: serving on {context.nats} (pensieve.v1.chat, "
        f"pensieve.v1.conversations.*; this engine: {own})"
    )
    options = context.serve
    if options.http is not None:
        http = options.http
        _say(
            f"pensieve: OpenAI-compatible API on http://{http.host}:{http.port}/v1 "
            f"(model {http.model!r}; /metrics, /health)"
        )
    if options.metrics_port is not None:
        _say(f"pensieve: metrics on http://{options.metrics_host}:{options.metrics_port}/metrics")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
