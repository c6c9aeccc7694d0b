"""Tenants kept apart by NATS accounts across engines: a real 3-node nats-server cluster with
JetStream, every node with the accounts `pensieve serve` writes (the service's, each tenant's),
JetStream enabled for the service's account, and two engines (`pensieve serve --turn-log
jetstream`, the real SmolLM2 on the CPU) logged in as the service. Tenants log in as themselves
and send on the plain API subjects, which their account's import maps to theirs:

- another tenant can neither continue nor read a tenant's conversation, through either engine
  or through any, while the tenant goes on with it through the engine that does not hold it;
- another tenant's prompt reuses nothing of a tenant's cached prefix;
- a tenant cannot send on another tenant's subjects of the service;
- an engine killed, its tenant's conversation goes on at the other engine, which adopts it for
  that tenant alone.
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
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from pensieve.actors.wire import subjects
from pensieve.ops.nats_auth import SERVICE_USER, new_secret
from pensieve.ops.nats_config import ServerConfig, Tenant, hash_password
from tests.ops.nats_cluster import EngineProcess, NatsCluster

pytestmark = pytest.mark.slow

TENANTS = ("acme", "intruder")
MIN_CACHED = 256  # of a ~450-token prefix, in whole 32-token chunks
SETTLE_S = 0.3  # the holder's KV events reach the ingresses meanwhile
FAILOVER_S = 30.0  # the engines' leases last 2 s (`nats_cluster.EngineProcess`)


class Deployment:
    def __init__(self, cluster: NatsCluster, passwords: dict[str, str], tenants: dict[str, Tenant]):
        self.cluster = cluster
        self.passwords = passwords
        self.tenants = tenants
        self.ids: list[str] = []
        self.processes: list[EngineProcess] = []
        self.killed: set[int] = set()

    async def _ask(self, tenant: str, subject: str, body: dict[str, Any], timeout: float) -> Any:
        login = self.tenants[tenant].connect_kwargs(self.cluster.urls, self.passwords[tenant])
        client = await nats.connect(**login)
        try:
            msg = await client.request(subject, orjson.dumps(body), timeout=timeout)
            return orjson.loads(msg.data)
        finally:
            await client.close()

    def ask(self, tenant: str, subject: str, body: dict[str, Any], timeout: float = 120) -> Any:
        return asyncio.run(self._ask(tenant, subject, body, timeout))

    def chat(self, tenant: str, body: dict[str, Any], engine: str | None = None) -> Any:
        chat = subjects.CHAT
        subject = chat if engine is None else subjects.engine_subject(engine, chat)
        return self.ask(tenant, subject, body)

    def stored_turn(self, tenant: str, conv_id: str, number: int) -> dict[str, Any] | None:
        """Turn `number` of the conversation once no turn of it runs; None if it has none."""
        body = {"conversation_id": conv_id, "cursor": str(number), "limit": 1}
        got = self.ask(tenant, subjects.CONVERSATIONS_GET, body)
        while got.get("busy"):
            time.sleep(0.2)
            got = self.ask(tenant, subjects.CONVERSATIONS_GET, body)
        assert "error" not in got, got
        return dict(got["turns"][0]) if got["turns"] else None

    def prefixed(self, tenant: str, question: str) -> dict[str, Any]:
        """A resent history: a long system prompt, the same for every call, and a question."""
        time.sleep(SETTLE_S)
        rules = " ".join(f"Rule {i}: keep answer {i} on comets short." for i in range(40))
        messages = [
            {"role": "system", "content": "You answer questions about comets. " + rules},
            {"role": "user", "content": question},
        ]
        reply = self.chat(tenant, {"messages": messages, "max_tokens": 2})
        assert "error" not in reply, reply
        return dict(reply)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    folder: Path = tmp_path_factory.mktemp("accounts")
    passwords = {name: new_secret() for name in TENANTS}
    tenants = {name: Tenant(name, hash_password(passwords[name])) for name in TENANTS}
    service = new_secret()
    config = ServerConfig("127.0.0.1:0", service, new_secret(), "spare", tuple(tenants.values()))
    secret = folder / "service.password"
    secret.write_text(service)
    secret.chmod(0o600)
    login = ("--nats-user", SERVICE_USER, "--nats-password-file", str(secret))
    with NatsCluster(folder / "nats", config) as cluster:
        a = EngineProcess(cluster.urls[0], folder / "a", *login, "--placement", "prefix")
        b = EngineProcess(cluster.urls[1], folder / "b", *login, "--placement", "prefix")
        try:
            deployed = Deployment(cluster, passwords, tenants)
            deployed.ids = [a.wait_ready(), b.wait_ready()]
            deployed.processes = [a, b]
            time.sleep(2.0)  # every ingress hears every engine's load report
            yield deployed
        finally:
            codes = [p.stop() for p in (a, b)]
        alive = [i for i in range(2) if i not in deployed.killed]
        assert [codes[i] for i in alive] == [0] * len(alive), [a.log(), b.log()]


def test_tenants_stay_apart_across_engines_by_their_nats_accounts(deployment: Deployment) -> None:
    made = deployment.chat("acme", {"message": "Remember the word apple.", "max_tokens": 2})
    assert "error" not in made, made
    conv_id = made["conversation_id"]
    holder = subjects.owner(conv_id)
    assert holder in deployment.ids
    other = next(e for e in deployment.ids if e != holder)
    turn = {"conversation_id": conv_id, "message": "Which word?", "max_tokens": 2}
    for engine in (*deployment.ids, None):  # through either engine, or any
        refused = deployment.chat("intruder", turn, engine)
        assert refused["error"]["code"] == "not_found", refused
        get = subjects.CONVERSATIONS_GET
        subject = get if engine is None else subjects.engine_subject(engine, get)
        read = deployment.ask("intruder", subject, {"conversation_id": conv_id})
        assert read["error"]["code"] == "not_found", read
    # its tenant goes on through the other engine, which sends the turn to its holder
    assert deployment.chat("acme", turn, other)["turn"] == 1

    # acme's cached prefix serves acme, and never the intruder
    deployment.prefixed("acme", "What is it?")
    again = deployment.prefixed("acme", "Why?")
    assert again["usage"]["cached_tokens"] >= MIN_CACHED, again["usage"]
    assert deployment.prefixed("intruder", "Who?")["usage"]["cached_tokens"] == 0

    # the service's subjects of another tenant are not the intruder's to send on
    acme_chat = subjects.tenant_subject("acme", subjects.CHAT)
    with pytest.raises((NatsTimeout, NoRespondersError)):
        deployment.ask("intruder", acme_chat, turn, timeout=3)


def test_a_killed_engines_conversation_goes_on_at_the_other_for_its_tenant_alone(
    deployment: Deployment,
) -> None:
    first, second = deployment.ids
    made = deployment.chat("acme", {"message": "Remember the word pear.", "max_tokens": 2}, first)
    conv_id = made["conversation_id"]
    assert subjects.owner(conv_id) == first, made
    deployment.processes[0].kill()
    deployment.killed.add(0)
    # the turn says its number: a copy sent again once one was committed is refused `conflict`
    turn = {"conversation_id": conv_id, "message": "Which word?", "max_tokens": 2, "turn": 1}
    deadline = time.monotonic() + FAILOVER_S
    while True:  # the other engine adopts it once the killed one's lease runs out
        reply = deployment.chat("acme", turn, second)
        if reply.get("error", {}).get("code") == "conflict":
            reply = deployment.stored_turn("acme", conv_id, 1) or reply
        if "turn" in reply or time.monotonic() > deadline:
            break
        assert reply["error"]["code"] in ("unavailable", "conflict"), reply
        time.sleep(0.5)
    assert reply.get("turn") == 1, reply
    refused = deployment.chat("intruder", {**turn, "message": "And now?"}, second)
    assert refused["error"]["code"] == "not_found", refused
    read = deployment.ask(
        "intruder",
        subjects.engine_subject(second, subjects.CONVERSATIONS_GET),
        {"conversation_id": conv_id},
    )
    assert read["error"]["code"] == "not_found", read
