"""`pensieve actor NAME`: one actor of an engine in this process, meeting the others on a NATS
server (`--nats-url`); each takes the options of `pensieve serve` that it uses
(ops/cli_actor.py), and each waits for the others rather than failing when it starts first. The
engine is named by the store in `--data-dir`: give every actor of one engine the same. The actors
and how each starts are the table in `ops/deploy.py`:

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
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence

from pensieve.ops.context import Context, Nats, ServeOptions, remote_engine
from pensieve.ops.deploy import Entry, actor_plan, check_ports, until_signal
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.executor_ranks import ExecutorRanks, RankSpec
from pensieve.ops.factory import cpu_threads, frozen_heap
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore

logger = logging.getLogger("pensieve")

SCHEDULER_WAITS_S = 24 * 3600  # for its executor: the actors of an engine start in any order


def run_actor(name: str, engine: EngineOptions, options: ServeOptions, started: float) -> int:
    """Run actor `name` until SIGINT or SIGTERM."""
    if options.nats_url is None:
        raise ValueError("pensieve actor needs --nats-url: the actors of an engine meet there")
    entries = actor_plan(name, options)
    check_ports(entries, options)
    nats = Nats(
        options.nats_url,
        options.nats_auth and options.nats_auth.connect_options(),
        options.events_auth and options.events_auth.connect_options(),
    )
    provider = setup_tracing(options.trace)
    try:
        options.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with ConversationStore(options.data_dir) as store:
            if name == "executor" and engine.tensor_parallel > 1:
                return _executor_ranks(engine, options)
            # every actor's start-up heap (imports, and the model or tokenizer it loads) stays
            # out of the garbage collections made while it serves: a full one would stall it
            with frozen_heap():
                asyncio.run(_run(name, entries, engine, options, nats, store, started))
        return 0
    finally:
        if provider is not None:
            provider.shutdown()


async def _run(
    name: str,
    entries: Sequence[Entry],
    engine: EngineOptions,
    options: ServeOptions,
    nats: Nats,
    store: ConversationStore,
    started: float,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        built = None
        if name == "scheduler":  # its engine steps the executor actor over the bus
            waiting = remote_engine(engine, nats, store.engine_id(), SCHEDULER_WAITS_S)
            built = await stack.enter_async_context(waiting)
        context = Context(nats, store, engine, options, cpu_threads(engine), built)

        def announce() -> None:
            logger.info("ready in %.1f s", time.monotonic() - started)
            for entry in entries:
                print(entry.ready(context), file=sys.stderr, flush=True)

        await until_signal(context, entries, announce)


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
