"""Tenants against a real nats-server with accounts, as `pensieve serve` starts it, and
the real engine behind it: a tenant reaches only its own conversations, sees none of another's
traffic and cannot answer as the service; nobody connects without credentials."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import orjson
import pytest

from pensieve.actors.wire import subjects
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_accounts import add_tenant, remove_tenant
from pensieve.ops.nats_server import EmbeddedNats
from tests.ops.serving import serve_on_thread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2, smollm2_chat, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A served engine on a nats-server with accounts; tenants alice and bob."""
    data_dir: Path = tmp_path_factory.mktemp("data")
    built = assemble(
        EngineOptions(model="smollm2", gpu_cache_tokens=1024, cpu_cache_tokens=1024),
        smollm2,
        smollm2_chat,
    )
    with EmbeddedNats(auth_data_dir=data_dir) as server:
        assert server.service_auth is not None and server.events_auth is not None
        connect = server.service_auth.connect_options()
        events = server.events_auth.connect_options()
        with serve_on_thread(built, data_dir, server.url, connect=connect, events=events):
            yield {
                "url": server.url,
                "alice": add_tenant(data_dir, "alice"),
                "bob": add_tenant(data_dir, "bob"),
                "service": connect,
                "data_dir": data_dir,
            }


async def request(client: Any, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    msg = await client.request(subject, orjson.dumps(body), timeout=60)
    return dict(orjson.loads(msg.data))


def code(reply: dict[str, Any]) -> str | None:
    return reply.get("error", {}).get("code")


def test_a_tenant_reaches_only_its_own_conversations(engine) -> None:
    async def go() -> None:
        alice = await nats.connect(**engine["alice"])
        bob = await nats.connect(**engine["bob"])
        try:
            first = await request(alice, subjects.CHAT, {"message": "Hi", "max_tokens": 3})
            conv = first["conversation_id"]
            mine = {"conversation_id": conv}
            listed = await request(alice, subjects.CONVERSATIONS_LIST, {})
            assert listed["conversations"] == [conv]
            # bob: nothing of alice's, and every way in is not_found, as for no conversation
            assert (await request(bob, subjects.CONVERSATIONS_LIST, {}))["conversations"] == []
            assert code(await request(bob, subjects.CONVERSATIONS_GET, mine)) == "not_found"
            turn = {**mine, "message": "Hello", "max_tokens": 2}
            assert code(await request(bob, subjects.CHAT, turn)) == "not_found"
            rewrite = {
                **mine,
                "messages": [{"role": "user", "content": "Mine now"}],
                "max_tokens": 2,
            }
            assert code(await request(bob, subjects.CHAT, rewrite)) == "not_found"
            assert code(await request(bob, subjects.CONVERSATIONS_DELETE, mine)) == "not_found"
            owned = subjects.engine_subject(subjects.owner(conv) or "", subjects.CHAT)
            assert code(await request(bob, owned, turn)) == "not_found"
            # alice's conversation is as she left it, and goes on
            got = await request(alice, subjects.CONVERSATIONS_GET, mine)
            assert got["num_turns"] == 1 and got["turns"][0]["text"] == first["text"]
            second = await request(alice, subjects.CHAT, {**turn, "max_tokens": 3})
            assert second["turn"] == 1
        finally:
            await alice.close()
            await bob.close()

    asyncio.run(go())


def test_a_tenant_sees_no_traffic_of_another_and_cannot_answer_as_the_service(engine) -> None:
    async def go() -> None:
        errors: list[Exception] = []

        async def on_error(error: Exception) -> None:
            errors.append(error)

        alice = await nats.connect(**engine["alice"])
        bob = await nats.connect(**engine["bob"], error_cb=on_error)
        seen: list[bytes] = []

        async def note(msg: Any) -> None:
            seen.append(msg.data)

        try:
            for subject in (">", subjects.CHAT, "pensieve.tenant.>", "pensieve.internal.>"):
                await bob.subscribe(subject, cb=note)
            await bob.subscribe(subjects.CHAT, queue="pensieve", cb=note)
            await bob.flush()
            for _ in range(4):  # every one answered by the engine, none by bob
                reply = await request(alice, subjects.CHAT, {"message": "Hi", "max_tokens": 2})
                assert len(reply["token_ids"]) == 2, reply
            await asyncio.sleep(0.2)
            assert seen == []
            # every one of its subscriptions was refused by the server
            refused = [e for e in errors if "permissions violation" in str(e).lower()]
            assert len(refused) == 5, errors
        finally:
            await alice.close()
            await bob.close()

    asyncio.run(go())


def test_the_service_account_does_not_see_a_tenants_conversations(engine) -> None:
    async def go() -> None:
        alice = await nats.connect(**engine["alice"])
        service = engine["service"]
        own = await nats.connect(engine["url"], user=service.user, password=service.password)
        try:
            conv = (await request(alice, subjects.CHAT, {"message": "Hi", "max_tokens": 2}))[
                "conversation_id"
            ]
            listed = await request(own, subjects.CONVERSATIONS_LIST, {})
            assert conv not in listed["conversations"]
            mine = {"conversation_id": conv}
            assert code(await request(own, subjects.CONVERSATIONS_GET, mine)) == "not_found"
        finally:
            await alice.close()
            await own.close()

    asyncio.run(go())


def test_nobody_connects_without_credentials(engine) -> None:
    async def go() -> None:
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(
                engine["url"], max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2
            )

    asyncio.run(go())


LONG = {
    "message": "Count from one to one thousand in words.",
    "max_tokens": 400,
    "ignore_eos": True,
}


@pytest.mark.parametrize("stream", [True, False])
def test_a_tenants_turn_is_cancelled_when_its_connection_closes(engine, stream) -> None:
    async def go() -> None:
        alice, again = await nats.connect(**engine["alice"]), await nats.connect(**engine["alice"])
        try:
            made = await request(alice, subjects.CHAT, {"message": "Hi", "max_tokens": 2})
            conv = {"conversation_id": made["conversation_id"]}
            inbox = alice.new_inbox()
            sub = await alice.subscribe(inbox)
            body = {**LONG, **conv, "stream": stream}
            await alice.publish(subjects.CHAT, orjson.dumps(body), reply=inbox)
            if stream:
                await sub.next_msg(timeout=60)
            else:  # under way once the conversation is busy; a second to get into its reply
                while not (await request(again, subjects.CONVERSATIONS_GET, conv))["busy"]:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)
            begin = time.monotonic()
            await alice.close()
            while (got := await request(again, subjects.CONVERSATIONS_GET, conv))["busy"]:
                assert time.monotonic() - begin < 10, "the turn went on without its requester"
                await asyncio.sleep(0.1)
            # stored as cancelled with what it had, or (cancelled before its first token) not
            if stream or got["num_turns"] == 2:
                cancelled = got["turns"][1]
                assert cancelled["finish_reason"] == "cancelled"
                assert cancelled["completion_tokens"] < LONG["max_tokens"]
            after = await request(again, subjects.CHAT, {**conv, "message": "Ok", "max_tokens": 2})
            assert after["turn"] == got["num_turns"]
        finally:
            await alice.close()
            await again.close()

    asyncio.run(go())


def test_a_removed_tenants_conversations_come_back_to_a_tenant_of_its_name(engine) -> None:
    async def go() -> None:
        first = await nats.connect(
            **await asyncio.to_thread(add_tenant, engine["data_dir"], "carol")
        )
        conv = (await request(first, subjects.CHAT, {"message": "Hi", "max_tokens": 2}))[
            "conversation_id"
        ]
        await first.close()
        await asyncio.to_thread(remove_tenant, engine["data_dir"], "carol")
        again = await nats.connect(
            **await asyncio.to_thread(add_tenant, engine["data_dir"], "carol")
        )
        try:
            assert (await request(again, subjects.CONVERSATIONS_LIST, {}))["conversations"] == [
                conv
            ]
            turn = {"conversation_id": conv, "message": "Again", "max_tokens": 2}
            assert (await request(again, subjects.CHAT, turn))["turn"] == 1
        finally:
            await again.close()

    asyncio.run(go())
