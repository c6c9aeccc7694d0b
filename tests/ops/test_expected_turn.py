"""A chat turn that says which turn it expects to be (`turn`), over a real nats-server with the
real SmolLM2 and every actor of `pensieve serve`: the same turn sent twice, one after the other
or both at once, is committed once and the other copy is refused `conflict`; a number that is
not the conversation's next is refused the same way, and the conversation goes on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from pensieve.actors.wire import subjects
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats
from tests.ops.serving import request, serve_on_thread

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def url(smollm2, smollm2_chat, tmp_path_factory) -> Iterator[str]:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path_factory.mktemp("d"), server.url):
        yield server.url


async def chat(client: Any, **body: Any) -> dict[str, Any]:
    return await request(client, subjects.CHAT, {"max_tokens": MAX_TOKENS, **body})


async def stored(client: Any, conv_id: str) -> dict[str, Any]:
    got = await request(client, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
    assert "error" not in got, got
    return got


def conflict(reply: dict[str, Any], *said: str) -> None:
    error = reply.get("error", {})
    assert error.get("code") == "conflict" and error.get("param") == "turn", reply
    for words in said:
        assert words in error["message"], reply


def test_a_turn_sent_again_after_its_commit_is_refused_and_stored_once(url) -> None:
    async def go() -> None:
        client = await nats.connect(url)
        try:
            first = await chat(client, message="What is the capital of France?", turn=0)
            conv = first["conversation_id"]
            assert first["turn"] == 0, first
            again = {"conversation_id": conv, "message": "And of Italy?", "turn": 1}
            second = await chat(client, **again)
            assert second["turn"] == 1, second
            conflict(await chat(client, **again), "has 2 turns", "turn 1 is stored")
            got = await stored(client, conv)
            assert got["num_turns"] == 2 and not got["busy"], got
            assert [t["message"] for t in got["turns"]] == [
                "What is the capital of France?",
                "And of Italy?",
            ]
            assert got["turns"][1]["text"] == second["text"]
        finally:
            await client.close()

    asyncio.run(go())


def test_the_same_turn_sent_twice_at_once_is_committed_once(url) -> None:
    async def go() -> None:
        client = await nats.connect(url)
        try:
            first = await chat(client, message="Name a colour.")
            conv = first["conversation_id"]
            body = {
                "conversation_id": conv,
                "message": "Count to twenty.",
                "turn": 1,
                "max_tokens": 64,
                "ignore_eos": True,
            }
            replies = await asyncio.gather(chat(client, **body), chat(client, **body))
            answered = [r for r in replies if "error" not in r]
            assert len(answered) == 1 and answered[0]["turn"] == 1, replies
            refused = next(r for r in replies if "error" in r)
            conflict(refused, "has 1 turn and turn 1 in progress")
            got = await stored(client, conv)
            assert got["num_turns"] == 2, got
            assert [t["message"] for t in got["turns"]] == ["Name a colour.", "Count to twenty."]
        finally:
            await client.close()

    asyncio.run(go())


def test_a_turn_number_not_the_next_is_refused_and_the_conversation_goes_on(url) -> None:
    async def go() -> None:
        client = await nats.connect(url)
        try:
            first = await chat(client, message="Say one word.")
            conv = first["conversation_id"]
            ahead = await chat(client, conversation_id=conv, message="Another.", turn=3)
            conflict(ahead, "has 1 turn:", "its next turn is turn 1, not 3")
            got = await stored(client, conv)
            assert got["num_turns"] == 1 and not got["busy"], got
            assert got["turns"][0]["text"] == first["text"]
            # the turn sent with its number, and one sent without any, go on from it
            right = await chat(client, conversation_id=conv, message="Another.", turn=1)
            assert right["turn"] == 1, right
            anyhow = await chat(client, conversation_id=conv, message="And one more.")
            assert anyhow["turn"] == 2, anyhow
            # a new conversation's first turn is turn 0: another number is no turn of it
            new = await chat(client, message="Hello.", turn=1)
            assert new["error"]["code"] == "invalid_request", new
            assert new["error"]["param"] == "turn", new
        finally:
            await client.close()

    asyncio.run(go())
