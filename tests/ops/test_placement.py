"""Placement by the ingress, with two engines (`pensieve serve --turn-log jetstream`, processes
of their own, the real SmolLM2 on the CPU) on a real 3-node nats-server cluster, through the
shared subjects any engine's ingress answers (a client that names no engine):

- with one engine loaded (long turns held on it), new conversations go to the other;
- a stateless client that resends a long shared prefix is answered by the engine that holds it,
  from its cache, every time, rather than by either engine; so is one that resends its history
  the moment each reply comes;
- tenants stay apart across engines: another tenant cannot read or continue a conversation
  through either engine, and its prompt reuses nothing of a tenant's cached prefix.

A tenant here is the one the subject names (`pensieve.tenant.<t>.v1.*`), as NATS's accounts map
it; the cluster runs without accounts, so the test client sends on those subjects itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from pensieve.actors.wire import subjects
from pensieve.actors.wire.messages import LoadReport, decode
from tests.ops.nats_cluster import EngineProcess, NatsCluster

pytestmark = pytest.mark.slow

POLICY = "prefix"
MIN_CACHED = 256  # of a ~450-token shared prefix, in whole 32-token chunks
HELD_S = 24.0  # how long the loaded engine's long turns run
SETTLE_S = 0.3  # a client's pause between two requests: the holder's KV events arrive meanwhile


def system_prompt(topic: str) -> str:
    """About 450 tokens of rules, unique to `topic`."""
    return f"You answer questions about {topic}. " + " ".join(
        f"Rule {i}: keep answer {i} on {topic} short." for i in range(40)
    )


class Engines:
    """The cluster, its two engines, and a client."""

    def __init__(self, cluster: NatsCluster, a: EngineProcess, b: EngineProcess) -> None:
        self.cluster = cluster
        self.ids = [a.wait_ready(), b.wait_ready()]
        self.processes = [a, b]

    async def ask(self, subject: str, body: dict[str, Any], timeout: float = 120) -> Any:
        client = await nats.connect(self.cluster.urls)
        try:
            msg = await client.request(subject, orjson.dumps(body), timeout=timeout)
            return orjson.loads(msg.data)
        finally:
            await client.close()

    def chat(self, body: dict[str, Any], tenant: str | None = None, engine: str | None = None):
        subject = subjects.CHAT
        if engine is not None:
            subject = subjects.engine_subject(engine, subject)
        if tenant is not None:
            subject = subjects.tenant_subject(tenant, subject)
        return asyncio.run(self.ask(subject, body))

    def stateless(self, topic: str, question: str, tenant: str | None = None) -> dict[str, Any]:
        """A resent history: the topic's long system prompt and one question."""
        time.sleep(SETTLE_S)
        messages = [
            {"role": "system", "content": system_prompt(topic)},
            {"role": "user", "content": question},
        ]
        reply = self.chat({"messages": messages, "max_tokens": 2}, tenant)
        assert "error" not in reply, reply
        return dict(reply)


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["cached_tokens"])


def engine_of(reply: dict[str, Any]) -> str | None:
    return subjects.owner(reply["conversation_id"])


async def reports(urls: list[str], engine_id: str, until, timeout: float = 60) -> LoadReport:  # type: ignore[no-untyped-def]
    """The first load report of the engine that satisfies `until`."""
    client = await nats.connect(urls)
    try:
        sub = await client.subscribe(subjects.engine_load(engine_id))
        deadline = time.monotonic() + timeout
        while True:
            msg = await sub.next_msg(timeout=max(deadline - time.monotonic(), 0.01))
            report = decode(msg.data, LoadReport)
            if until(report):
                return report
    finally:
        await client.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[Engines]:
    folder: Path = tmp_path_factory.mktemp("placement")
    placement = ("--placement", POLICY)
    with NatsCluster(folder / "nats") as cluster:
        a = EngineProcess(cluster.urls[0], folder / "a", *placement)
        b = EngineProcess(cluster.urls[1], folder / "b", *placement)
        try:
            both = Engines(cluster, a, b)
            for engine_id in both.ids:  # each ingress places only on engines that report
                asyncio.run(reports(cluster.urls, engine_id, lambda r: True))
            time.sleep(1.0)
            yield both
        finally:
            codes = [a.stop(), b.stop()]
        assert codes == [0, 0], [a.log(), b.log()]


def test_new_conversations_go_to_the_engine_that_is_not_loaded(engines: Engines) -> None:
    loaded, idle = engines.ids
    long_turn = {
        "message": "Tell me a long story. " + "Please make it long. " * 30,
        "max_tokens": 2000,
        "ignore_eos": True,
        "timeout_s": HELD_S,  # then the engine cancels them
    }

    async def run() -> list[str | None]:
        held = [
            asyncio.ensure_future(
                engines.ask(subjects.engine_subject(loaded, subjects.CHAT), long_turn, 300)
            )
            for _ in range(3)
        ]
        busy = await reports(
            engines.cluster.urls, loaded, lambda r: r.num_running + r.num_waiting >= 3
        )
        assert busy.num_active_tokens > 3 * 100
        landed = []
        began = time.monotonic()
        for i in range(6):
            body = {"message": f"Say hello to person {i}.", "max_tokens": 2}
            reply = await engines.ask(subjects.CHAT, body)
            assert "error" not in reply, reply
            landed.append(engine_of(reply))
        assert time.monotonic() - began < HELD_S / 2  # while it was loaded
        for reply in await asyncio.gather(*held):
            assert reply["finish_reason"] == "cancelled", reply
        return landed

    assert asyncio.run(run()) == [idle] * 6


def test_a_resent_prefix_goes_to_the_engine_that_holds_it(engines: Engines) -> None:
    for topic in ("volcanoes", "tides", "glaciers"):
        first = engines.stateless(topic, "What is it?")
        holder = engine_of(first)
        for question in ("Why?", "Where?"):
            again = engines.stateless(topic, question)
            assert (engine_of(again), topic) == (holder, topic)
            assert cached(again) >= MIN_CACHED, again["usage"]


def test_a_history_resent_as_its_reply_comes_goes_where_its_turn_before_ran(
    engines: Engines,
) -> None:
    """An agent sends its next turn the moment a reply comes, with no pause for events to
    arrive: the engine reports its load as the turn ends, before the reply, so the turn just
    ended does not weigh against the engine that holds its history."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt("deserts")}]
    answers = ("A desert is a dry place.", "Little rain falls there.", "It is in Antarctica.")

    async def run() -> list[dict[str, Any]]:
        client = await nats.connect(engines.cluster.urls)
        replies = []
        try:
            for question, answer in zip(("What is it?", "Why?", "Where?"), answers, strict=True):
                messages.append({"role": "user", "content": question})
                body = {"messages": messages, "max_tokens": 8, "ignore_eos": True}
                msg = await client.request(subjects.CHAT, orjson.dumps(body), timeout=120)
                replies.append(orjson.loads(msg.data))
                assert "error" not in replies[-1], replies[-1]
                messages.append({"role": "assistant", "content": answer})  # a recorded reply
        finally:
            await client.close()
        return replies

    first, *later = asyncio.run(run())
    holder, before = engine_of(first), first["usage"]["prompt_tokens"]
    for reply in later:
        # every whole chunk of the prompt before it, from the engine that computed it
        assert (engine_of(reply), cached(reply)) == (holder, before // 32 * 32), reply["usage"]
        before = reply["usage"]["prompt_tokens"]


def test_tenants_stay_apart_across_engines(engines: Engines) -> None:
    made = engines.chat({"message": "Remember the word apple.", "max_tokens": 2}, "acme")
    conv_id, holder = made["conversation_id"], engine_of(made)
    other = next(e for e in engines.ids if e != holder)
    for engine in (*engines.ids, None):  # through either engine, or any
        turn = {"conversation_id": conv_id, "message": "Which word?", "max_tokens": 2}
        refused = engines.chat(turn, "intruder", engine)
        assert refused["error"]["code"] == "not_found", refused
        get = subjects.CONVERSATIONS_GET
        subject = get if engine is None else subjects.engine_subject(engine, get)
        read = asyncio.run(
            engines.ask(subjects.tenant_subject("intruder", subject), {"conversation_id": conv_id})
        )
        assert read["error"]["code"] == "not_found", read
    # its tenant goes on through the other engine, which sends the turn to its holder
    turn = {"conversation_id": conv_id, "message": "Which word?", "max_tokens": 2}
    assert engines.chat(turn, "acme", other)["turn"] == 1

    # acme's cached prefix serves acme, where it is, and never the intruder
    holder = engine_of(engines.stateless("comets", "What is it?", "acme"))
    for question in ("Why?", "Where?", "When?"):
        again = engines.stateless("comets", question, "acme")
        assert engine_of(again) == holder and cached(again) >= MIN_CACHED
    assert cached(engines.stateless("comets", "Who?", "intruder")) == 0
