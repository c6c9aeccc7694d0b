"""The table of actors (`ops/deploy.py`): it names exactly the actors `pensieve actor` offers,
`pensieve serve` enters them in dependency order, and every entry, started as its own
`pensieve actor NAME` process would start it (its own context, the engine's store), answers the
NATS service protocol on a real nats-server, the executor and the scheduler with the real
SmolLM2 on the CPU, and together they answer a turn."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from pensieve.actors.config import StepChannel
from pensieve.actors.ingress.http_actor import HttpConfig
from pensieve.actors.wire import subjects
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Bus
from pensieve.ops.cli import build_parser
from pensieve.ops.cli_actor import TAKEN_BY
from pensieve.ops.context import Context, Nats, ServeOptions, remote_engine
from pensieve.ops.deploy import ACTORS, METRICS, actor_plan, deployment, serve_plan
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.nats_server import EmbeddedNats, free_port
from pensieve.store import ConversationStore


def test_the_table_names_exactly_the_actors_the_cli_offers(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["actor", "--help"])
    usage = capsys.readouterr().out
    offered = re.search(r"positional arguments:\s+\{([a-z,-]+)\}", usage)
    assert offered is not None, usage
    assert set(offered.group(1).split(",")) == set(ACTORS)
    for name in ACTORS:  # every name runs its own entry, alone
        model = ["--model", "smollm2"] if name in TAKEN_BY["model"] else []
        args = ["actor", name, *model, "--nats-url", "nats://127.0.0.1:4222"]
        assert build_parser().parse_args(args).name == name
        assert [e.name for e in actor_plan(name, ServeOptions(Path("d"), tokenizers=1))][-1] == name
    with pytest.raises(ValueError, match="unknown actor"):
        actor_plan("metrics", ServeOptions(Path("d")))


def test_serve_starts_each_actor_before_whatever_sends_to_it() -> None:
    everything = ServeOptions(Path("d"), http=HttpConfig(8000), metrics_port=9000)
    assert [e.name for e in serve_plan(everything)] == [
        "executor",
        "tokenizer",
        "recompute-planner",
        "scheduler",
        "ingress",
        "http",
        "metrics",
    ]
    # tokenizers elsewhere, no HTTP, no metrics port: those entries are left out
    bare = ServeOptions(Path("d"), tokenizers=0)
    assert [e.name for e in serve_plan(bare)] == [
        "executor",
        "recompute-planner",
        "scheduler",
        "ingress",
    ]
    # a scheduler process runs its tokenizer replicas and metrics port beside it
    beside = ServeOptions(Path("d"), tokenizers=2, metrics_port=9000)
    assert actor_plan("scheduler", beside) == [ACTORS["tokenizer"], ACTORS["scheduler"], METRICS]


@pytest.mark.slow
def test_every_entry_starts_as_its_own_process_would_and_answers_ping(tmp_path: Path) -> None:
    engine = EngineOptions(
        model="smollm2", gpu_cache_tokens=256, cpu_cache_tokens=256, cpu_threads=1
    )
    with EmbeddedNats() as server:
        serve = ServeOptions(
            tmp_path,
            nats_url=server.url,
            tokenizers=0,  # the scheduler's text comes from the tokenizer actor, as in compose
            step_channel=StepChannel.NATS,
            http=HttpConfig(free_port(), model="smollm2"),
            api_keys_required=False,
        )
        asyncio.run(_every_actor(engine, serve, Nats(server.url)))


async def _every_actor(engine: EngineOptions, serve: ServeOptions, nats: Nats) -> None:
    # the order compose's processes may start in; each waits for what it needs
    order = ("executor", "tokenizer", "recompute-planner", "scheduler", "ingress", "http")
    assert set(order) == set(ACTORS)
    with ConversationStore(serve.data_dir) as store:
        engine_id = store.engine_id()
        async with contextlib.AsyncExitStack() as processes:
            running: dict[str, Any] = {}
            for name in order:
                built = None
                if name == "scheduler":
                    built = await processes.enter_async_context(
                        remote_engine(engine, nats, engine_id, timeout_s=60)
                    )
                context = Context(nats, store, engine, serve, 1, built)
                await processes.enter_async_context(deployment(context, actor_plan(name, serve)))
                running[name] = context.running[name]
            bus = await Bus.connect(nats.url)
            try:
                for started in running.values():
                    for actor in started if isinstance(started, list) else [started]:
                        await _answers_ping(bus, actor, engine_id)
                assert running["scheduler"].instance_id == engine_id  # /health pings it so
                body = {"message": "Hello!", "max_tokens": 3, "ignore_eos": True}
                reply = orjson.loads(
                    (await bus.client.request(subjects.CHAT, orjson.dumps(body), timeout=120)).data
                )
                assert len(reply["token_ids"]) == 3 and reply["turn"] == 0, reply
            finally:
                await bus.close()


async def _answers_ping(bus: Bus, actor: Actor, engine_id: str) -> None:
    assert actor.engine_id == engine_id
    service = subjects.actor_service(actor.name)
    answer = await bus.client.request(f"$SRV.PING.{service}.{actor.instance_id}", b"", timeout=5)
    ping = orjson.loads(answer.data)
    assert ping["type"] == "io.nats.micro.v1.ping_response", ping
    assert (ping["name"], ping["id"]) == (service, actor.instance_id)
