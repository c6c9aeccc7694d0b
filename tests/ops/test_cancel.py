"""Cancelling a turn over a real nats-server, with the real SmolLM2: a cancel message or the
turn's own timeout ends it at once; what it generated is its reply (the greedy prefix of the
whole reply), committed with finish_reason "cancelled", and the conversation goes on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import nats
import orjson
import pytest

from pensieve.actors.wire import subjects
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats
from tests.ops.serving import request, serve_on_thread

pytestmark = pytest.mark.slow

LONG = {
    "message": "Count from one to one thousand in words.",
    "max_tokens": 400,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def url(smollm2, smollm2_chat, tmp_path_factory) -> Iterator[str]:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path_factory.mktemp("d"), server.url):
        yield server.url


def test_a_cancel_message_ends_a_streamed_turn_and_the_conversation_goes_on(url) -> None:
    async def go() -> None:
        client = await nats.connect(url)
        try:
            inbox = client.new_inbox()
            sub = await client.subscribe(inbox)
            await client.publish(subjects.CHAT, orjson.dumps({**LONG, "stream": True}), reply=inbox)
            first = orjson.loads((await sub.next_msg(timeout=120)).data)
            conv = first["conversation_id"]  # a new conversation's deltas name it
            begin = time.monotonic()
            answer = await request(client, subjects.CHAT_CANCEL, {"conversation_id": conv})
            assert answer == {"conversation_id": conv, "cancelled": True}
            while "delta" in (last := orjson.loads((await sub.next_msg(timeout=30)).data)):
                pass
            assert time.monotonic() - begin < 10
            assert last["finish_reason"] == "cancelled" and last["done"] is True
            partial = last["token_ids"]
            assert 0 < len(partial) < LONG["max_tokens"]
            # nothing is in flight now; the conversation goes on from the cancelled turn
            idle = await request(client, subjects.CHAT_CANCEL, {"conversation_id": conv})
            assert idle["cancelled"] is False
            got = await request(client, subjects.CONVERSATIONS_GET, {"conversation_id": conv})
            assert got["turns"][0]["finish_reason"] == "cancelled"
            assert got["turns"][0]["completion_tokens"] == len(partial)
            second = await request(
                client,
                subjects.CHAT,
                {"conversation_id": conv, "message": "Stop.", "max_tokens": 3, "ignore_eos": True},
            )
            assert second["turn"] == 1 and len(second["token_ids"]) == 3
            # what the cancelled turn said is the greedy beginning of the whole reply: the
            # same prompt's first as many tokens in a new conversation
            whole = await request(client, subjects.CHAT, {**LONG, "max_tokens": len(partial)})
            assert whole["token_ids"] == partial
        finally:
            await client.close()

    asyncio.run(go())


def test_a_turn_past_its_timeout_is_cancelled(url) -> None:
    async def go() -> None:
        client = await nats.connect(url)
        try:
            begin = time.monotonic()
            reply = await request(client, subjects.CHAT, {**LONG, "timeout_s": 1.0})
            assert time.monotonic() - begin < 10
            assert reply["finish_reason"] == "cancelled"
            assert len(reply["token_ids"]) < LONG["max_tokens"]
        finally:
            await client.close()

    asyncio.run(go())


def test_cancelling_an_unknown_conversation_is_not_found(url) -> None:
    async def go() -> None:
        client = await nats.connect(url)
        try:
            made = await request(client, subjects.CHAT, {"message": "Hi", "max_tokens": 1})
            engine_id = subjects.owner(made["conversation_id"])
            unknown = {"conversation_id": f"c-{engine_id}-0123456789abcdef"}
            answer = await request(client, subjects.CHAT_CANCEL, unknown)
            assert answer["error"]["code"] == "not_found"
            bad = await request(client, subjects.CHAT_CANCEL, {"conversation_id": 3})
            assert bad["error"]["code"] == "invalid_request"
        finally:
            await client.close()

    asyncio.run(go())


async def settled(client: Any, conv: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """The conversation once it has no turn in flight (a new one is not_found until its
    first turn is stored)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await request(client, subjects.CONVERSATIONS_GET, {"conversation_id": conv})
        if not got.get("busy", True) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("leaving", ["unsubscribes", "disconnects"])
def test_a_streamed_turn_whose_requester_goes_away_is_cancelled(url, leaving) -> None:
    async def go() -> None:
        client, other = await nats.connect(url), await nats.connect(url)
        try:
            inbox = client.new_inbox()
            sub = await client.subscribe(inbox)
            await client.publish(subjects.CHAT, orjson.dumps({**LONG, "stream": True}), reply=inbox)
            delta = await sub.next_msg(timeout=120)
            # the probe rides as the delta's reply subject; a reader needs nothing of it
            assert "delta" in orjson.loads(delta.data)
            conv = orjson.loads(delta.data)["conversation_id"]
            abandoned = (await request(other, subjects.STATS, {}))["turns_abandoned"]
            begin = time.monotonic()
            if leaving == "unsubscribes":
                await sub.unsubscribe()
                await client.flush()
            else:
                await client.close()
            got = await settled(other, conv)
            assert not got["busy"] and time.monotonic() - begin < 10
            (turn,) = got["turns"]
            assert turn["finish_reason"] == "cancelled"
            assert 0 < turn["completion_tokens"] < LONG["max_tokens"]
            stats = await request(other, subjects.STATS, {})
            assert stats["turns_abandoned"] == abandoned + 1
            after = {
                "conversation_id": conv,
                "message": "Stop.",
                "max_tokens": 3,
                "ignore_eos": True,
            }
            assert (await request(other, subjects.CHAT, after))["turn"] == 1
        finally:
            await client.close()
            await other.close()

    asyncio.run(go())
