"""An engine whose model runs as `--tensor-parallel N` executor ranks, for callers that step it
from their own thread (`pensieve replay`, the benchmarks): the ranks' processes, a nats-server
of its own on loopback unless one is given, and an event loop on a thread for the per-step
channel. `pensieve serve` and `pensieve actor` meet the ranks on their own event loops instead.

    with ranks_engine(options, data_dir) as built:
        built.engine.step()      # the plan goes to every rank; rank 0 answers

`executor_ranks` gives the ranks alone, for a caller that builds engines around them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from pensieve.actors.scheduler.remote_runner import RemoteRunner, connect_executor
from pensieve.actors.wire.bus import Bus
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.executor_ranks import ExecutorRanks, RankSpec
from pensieve.ops.factory import Built, assemble_remote, load_config_only
from pensieve.ops.nats_auth import NatsAuth
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.store import ConversationStore

T = TypeVar("T")
START_TIMEOUT_S = 1800.0  # loading a share of a 70B checkpoint takes minutes


def wait_ranks(ranks: ExecutorRanks, timeout_s: float = START_TIMEOUT_S) -> None:
    """Block until rank 0 serves; ValueError if the ranks could not start."""
    waited = 0.0
    while not ranks.wait_ready(1.0):
        waited += 1.0
        if ranks.failed is not None or waited > timeout_s:
            raise ValueError(ranks.failed or f"the executor ranks did not start in {timeout_s} s")


@contextlib.contextmanager
def ranks_engine(
    options: EngineOptions,
    data_dir: Path,
    nats_url: str | None = None,
    nats_auth: NatsAuth | None = None,
) -> Iterator[Built]:
    """A fresh engine (empty caches) whose model runs in `options.tensor_parallel` rank
    processes; `data_dir` holds the store that names the engine (and the CPU tier's index)."""
    loaded, chat = load_config_only(options)
    with executor_ranks(options, data_dir, nats_url, nats_auth) as runner:
        yield assemble_remote(options, loaded, chat, runner)


@contextlib.contextmanager
def executor_ranks(
    options: EngineOptions,
    data_dir: Path,
    nats_url: str | None = None,
    nats_auth: NatsAuth | None = None,
) -> Iterator[RemoteRunner]:
    """The `options.tensor_parallel` rank processes, started and serving, and a started
    `RemoteRunner` to them whose event loop runs on a thread of its own. Several engines may
    step it one after another (a benchmark's points): `fresh_runner` readies it for the next."""
    with contextlib.ExitStack() as stack:
        if nats_url is None:
            nats_url = stack.enter_context(EmbeddedNats()).url
        ranks = stack.enter_context(ExecutorRanks(RankSpec(options, nats_url, data_dir, nats_auth)))
        wait_ranks(ranks)
        with ConversationStore(data_dir) as store:
            engine_id = store.engine_id()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name="pensieve-step-channel", daemon=True
        )
        thread.start()
        stack.callback(thread.join)
        stack.callback(loop.call_soon_threadsafe, loop.stop)

        def run(coroutine: Coroutine[Any, Any, T]) -> T:
            return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

        connect = nats_auth.connect_options() if nats_auth is not None else None
        bus = run(Bus.connect(nats_url, "pensieve-scheduler", connect))
        stack.callback(lambda: run(bus.close()))
        runner = run(connect_executor(bus, engine_id, timeout_s=60))
        stack.callback(lambda: run(runner.close()))
        yield runner


def fresh_runner(runner: RemoteRunner) -> RemoteRunner:
    """`runner` ready for a new engine: the executor forgets the last engine's steps in flight
    (its KV blocks hold stale data the new engine writes before it reads), and swap totals
    count from here."""
    runner.settle()
    runner.count_from_now()
    return runner
