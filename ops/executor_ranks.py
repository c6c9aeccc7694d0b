"""`--tensor-parallel N`: the executor as N ranks, one process per GPU, over torch.distributed.

    with ExecutorRanks(spec):     # N rank processes, started again together if one dies
        ...                       # the scheduler meets rank 0 on the bus like any executor

Each rank joins the group (NCCL between GPUs, gloo between CPUs, and a gloo group beside NCCL
for the start-up handshake), loads its share of the model (`load_shard`), sizes its KV tiers to
what every rank can hold, takes rank 0's incarnation and engine id, and runs an ExecutorActor:
every rank takes every step plan from the bus, rank 0 answers for all (actors/executor/actor.py).
Rank 0 starts answering only once every other rank has subscribed to the plans, so no plan
reaches some ranks and not the others.

A rank that dies takes the group with it: the others are stopped and all N start again, a new
incarnation holding no KV. The scheduler, told its steps went to an executor that is gone,
forgets the KV and recomputes from the stored tokens, as for any restarted executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pensieve.actors.config import CacheConfig
from pensieve.actors.executor.actor import ExecutorActor
from pensieve.actors.wire.bus import Bus
from pensieve.models.loader import load_model
from pensieve.models.tensor_parallel import NCCL_ENV, TensorShard, split_config
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import DTYPES, cpu_threads, frozen_heap, rank_runner
from pensieve.ops.nats_auth import NatsAuth
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore

logger = logging.getLogger("pensieve")

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0  # a rank stopped while its peers are gone may wait in a collective forever


@dataclass(frozen=True)
class RankSpec:
    """What every rank process is started with."""

    engine: EngineOptions
    nats_url: str
    data_dir: Path  # the store that names the engine; rank 0 keeps the spill index in it
    nats_auth: NatsAuth | None = None
    trace: str = "none"  # where rank 0's spans go (ops/telemetry.py); it traces for all

    @property
    def world_size(self) -> int:
        return self.engine.tensor_parallel


def check_split(options: EngineOptions) -> None:
    """ValueError, before any rank starts, if the model does not split over the ranks asked
    for or this host has fewer GPUs."""
    n = options.tensor_parallel
    config = load_model(options.model, "meta", DTYPES[options.dtype]).config
    split_config(config, TensorShard(0, n))
    if options.device == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"--tensor-parallel {n} needs {n} GPUs; this host has {torch.cuda.device_count()}"
        )


def rank_main(rank: int, spec: RankSpec, rendezvous: str, ready: Any) -> None:
    """One rank's process: join the group, load the share, serve until SIGTERM (the one who
    started the ranks stops them; a Ctrl-C meant for it must not end a rank first, which would
    look like a rank that died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    os.environ.update(NCCL_ENV)
    cuda = spec.engine.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=spec.world_size,
    )
    tracing = setup_tracing(spec.trace) if rank == 0 else None
    try:
        # the communicators now, not inside the first CUDA graph capture
        dist.all_reduce(torch.zeros(1, device=device))
        control = dist.new_group(backend="gloo") if cuda else None
        shard = TensorShard(rank, spec.world_size)
        runner = rank_runner(spec.engine, shard, device, lambda c: _agree(c, control))
        with frozen_heap():
            asyncio.run(_serve_rank(spec, shard, runner, control, ready))
    finally:
        if tracing is not None:
            tracing.shutdown()  # flush the spans still batched
        dist.destroy_process_group()
    # stopped cleanly: leave without the interpreter's finalization, where a gloo group's worker
    # threads (the group still held, e.g. by the frozen heap) can abort the process
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die_with_parent() -> None:
    """On Linux, the kernel kills this rank when the process that started it dies (a supervisor
    killed by a timeout or the OOM killer), rather than leave it holding its GPU, waiting in a
    collective for peers that are gone."""
    parent = mp.parent_process()
    if not sys.platform.startswith("linux") or parent is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent.pid:  # it died before the call took effect
        os._exit(1)


def _agree(cache: CacheConfig, group: Any) -> CacheConfig:
    """The tiers every rank can hold: the fewest blocks of any rank, in each tier."""
    counts = torch.tensor([cache.num_gpu_blocks, cache.num_cpu_blocks], dtype=torch.long)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
    gpu, cpu = counts.tolist()
    return dataclasses.replace(cache, num_gpu_blocks=gpu, num_cpu_blocks=cpu)


def _from_first(value: str, group: Any) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return str(box[0])


async def _serve_rank(
    spec: RankSpec, shard: TensorShard, runner: Any, control: Any, ready: Any
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    first = shard.rank == 0
    store = ConversationStore(spec.data_dir) if first else None
    try:
        engine_id = _from_first(store.engine_id() if store is not None else "", control)
        incarnation = _from_first(secrets.token_hex(6), control)
        connect = spec.nats_auth.connect_options() if spec.nats_auth is not None else None
        bus = await Bus.connect(spec.nats_url, f"pensieve-executor-{shard.rank}", connect)
        actor = ExecutorActor(bus, engine_id, runner, cpu_threads(spec.engine), store, incarnation)
        if not first:  # subscribed before rank 0 answers: every plan reaches every rank
            await actor.start()
        await asyncio.to_thread(dist.barrier, group=control)
        if first:
            await actor.start()
            ready.set()
            print(
                f"pensieve: executor of engine {engine_id} ready on {spec.nats_url} "
                f"({spec.world_size} tensor-parallel ranks)",
                file=sys.stderr,
                flush=True,
            )
        try:
            await stop.wait()
        finally:
            await actor.stop()
    finally:
        if store is not None:
            store.close()


class ExecutorRanks:
    """The N rank processes, watched from a thread: when one ends, the others are stopped and
    all N start again, until `stop`. Ranks that end before they ever served (a model that does
    not load or split, too few GPUs) are not started again: `failed` says why."""

    def __init__(self, spec: RankSpec) -> None:
        check_split(spec.engine)
        self.spec = spec
        self.generation = 0  # how many times the ranks were started
        self.failed: str | None = None
        self._stopping = threading.Event()
        self._spawn = mp.get_context("spawn")
        self._ready = self._spawn.Event()  # set by rank 0 once every rank takes plans
        self._context: Any = None
        self._watcher: threading.Thread | None = None
        self._folder = tempfile.TemporaryDirectory(prefix="pensieve-ranks-")

    def start(self) -> None:
        self._launch()
        self._watcher = threading.Thread(target=self._watch, name="pensieve-ranks", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stopping.set()
        self._end(self._context)
        if self._watcher is not None:
            self._watcher.join()
        self._folder.cleanup()

    def __enter__(self) -> ExecutorRanks:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether rank 0 serves (every rank taking plans) within `timeout_s`."""
        return bool(self._ready.wait(timeout_s))

    @property
    def running(self) -> bool:
        return not self._stopping.is_set()

    def pids(self) -> list[int]:
        return [p.pid for p in self._context.processes] if self._context is not None else []

    def _launch(self) -> None:
        self.generation += 1
        rendezvous = str(Path(self._folder.name) / f"rendezvous-{self.generation}")
        self._ready = self._spawn.Event()
        self._context = mp.start_processes(
            rank_main,
            (self.spec, rendezvous, self._ready),
            nprocs=self.spec.world_size,
            join=False,
            start_method="spawn",
        )

    def _watch(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._context.join(timeout=0.5):
                    continue  # all still running
                ended = "every rank ended"
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
                # join() has stopped the others
                ended = str(error)
            except TypeError:  # join() read the exit code of a rank not yet reaped (None)
                continue
            if self._stopping.is_set():
                return
            if not self._ready.is_set():
                self.failed = f"the executor ranks did not start: {ended}"
                logger.error("%s", self.failed)
                self._stopping.set()
                return
            logger.warning("executor ranks: %s; starting all %d again", ended, self.spec.world_size)
            self._launch()

    @staticmethod
    def _end(context: Any) -> None:
        if context is None:
            return
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in context.processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
