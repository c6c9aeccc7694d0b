"""OpenAI's `n` (several choices for one request) over HTTP with the official `openai` client: a
real `pensieve serve` process with its nats-server, a tenant made by `pensieve tenant add`, the
real SmolLM2 on the CPU. Each choice is a turn of its own: greedy choices equal the one reply,
seeded ones the replies of the seeds counted up, streamed ones the whole ones."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import nats
import orjson
import pytest
from openai import OpenAI

from pensieve.actors.wire import subjects
from tests.ops.http_server import MODEL, Server, client, serving
from tests.ops.test_http import error_of

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Name a fruit."}]
IDS = {"return_token_ids": True}
SEED = 1234


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("data")) as running:
        yield running


@pytest.fixture(scope="module")
def alice(server) -> dict[str, Any]:
    return server.tenant("alice")


@pytest.fixture(scope="module")
def api(server, alice) -> OpenAI:
    return client(server, alice)


def ids_of(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_greedy_choices_are_the_one_reply_n_times(api) -> None:
    fields: dict[str, Any] = {"temperature": 0, "max_tokens": 10, "extra_body": IDS}
    one = api.chat.completions.create(model=MODEL, messages=USER, **fields)
    three = api.chat.completions.create(model=MODEL, messages=USER, n=3, **fields)
    assert [c.index for c in three.choices] == [0, 1, 2]
    reply = (one.choices[0].message.content, ids_of(one.choices[0]))
    assert [(c.message.content, ids_of(c)) for c in three.choices] == [reply] * 3
    # the prompt counted once, the completions of every choice
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens
    # a raw prompt's completions too
    text = {"model": MODEL, "prompt": "The sky is", **fields}
    once = api.completions.create(**text)
    twice = api.completions.create(n=2, **text)
    assert [(c.index, c.text) for c in twice.choices] == [(i, once.choices[0].text) for i in (0, 1)]
    assert twice.usage.completion_tokens == 2 * once.usage.completion_tokens


def test_seeded_choices_are_the_replies_of_the_seed_counted_up(api) -> None:
    fields: dict[str, Any] = {"temperature": 1.0, "max_tokens": 10, "extra_body": IDS}
    three = api.chat.completions.create(model=MODEL, messages=USER, n=3, seed=SEED, **fields)
    alone = [
        api.chat.completions.create(model=MODEL, messages=USER, seed=SEED + i, **fields)
        for i in range(3)
    ]
    drawn = [ids_of(c) for c in three.choices]
    assert drawn == [ids_of(reply.choices[0]) for reply in alone]
    assert len({tuple(ids) for ids in drawn}) > 1  # the choices differ
    assert three.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    text = {"model": MODEL, "prompt": "My favourite animal is", **fields}
    two = api.completions.create(n=2, seed=SEED, **text)
    assert [ids_of(c) for c in two.choices] == [
        ids_of(api.completions.create(seed=SEED + i, **text).choices[0]) for i in (0, 1)
    ]


def test_streamed_choices_reassemble_to_the_whole_ones(api) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": USER,
        "n": 2,
        "seed": SEED,
        "temperature": 1.0,
        "max_tokens": 10,
        "extra_body": IDS,
    }
    whole = api.chat.completions.create(**fields)
    texts, ids, finishes, usages = ["", ""], [[], []], [[], []], []
    raw = api.chat.completions.with_raw_response.create(
        stream=True, stream_options={"include_usage": True}, **fields
    )
    chunks = list(raw.parse())
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            extra = choice.model_extra or {}
            ids[choice.index] += extra.get("token_ids") or []
            if choice.finish_reason is not None:
                finishes[choice.index].append(extra["conversation_id"])
    assert texts == [c.message.content for c in whole.choices]
    assert ids == [ids_of(c) for c in whole.choices]
    # one finish chunk a choice, naming its conversation; the header names choice 0's
    [first], [second] = finishes
    assert raw.headers["X-Conversation-Id"] == first != second
    (usage,) = usages  # one usage chunk, the last
    assert chunks[-1].usage is usage and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_each_choice_is_a_conversation_a_stateless_chat_continues(api) -> None:
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, n=2, seed=SEED, temperature=1.0, max_tokens=10
    )
    first = raw.parse()
    conv_ids = [c.model_extra["conversation_id"] for c in first.choices]
    assert raw.headers["X-Conversation-Id"] == conv_ids[0] and len(set(conv_ids)) == 2
    for choice, conv_id in zip(first.choices, conv_ids, strict=True):
        chat = [
            *USER,
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": "Why?"},
        ]
        later = api.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat, temperature=0, max_tokens=4
        )
        assert later.headers["X-Conversation-Id"] == conv_id
        # the choice's own conversation: its whole prompt reused, not just shared chunks
        cached = later.parse().usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens


async def conversations(nc: Any) -> set[str]:
    listed = orjson.dumps({"limit": 1000})
    got = await nc.request(subjects.CONVERSATIONS_LIST, listed, timeout=30)
    return set(orjson.loads(got.data)["conversations"])


async def idle(nc: Any) -> bool:
    """Whether the engine runs no turn, within 10 s."""
    for _ in range(100):
        stats = orjson.loads((await nc.request(subjects.STATS, b"{}", timeout=30)).data)
        if stats["turns_in_flight"] == stats["requests"]["running"] == 0:
            return True
        await asyncio.sleep(0.1)
    return False


async def last_turns(nc: Any, conv_ids: set[str]) -> list[dict[str, Any]]:
    """Each conversation's last turn."""
    got = []
    for conv_id in sorted(conv_ids):
        body = orjson.dumps({"conversation_id": conv_id})
        answer = await nc.request(subjects.CONVERSATIONS_GET, body, timeout=30)
        got.append(orjson.loads(answer.data)["turns"][-1])
    return got


def test_a_client_that_leaves_cancels_every_choice(server, alice, api) -> None:
    async def go() -> list[dict[str, Any]]:
        nc = await nats.connect(**alice["nats"])
        try:
            before = await conversations(nc)
            await asyncio.to_thread(leave_a_stream)
            assert await idle(nc)  # a new conversation is listed once its turn has ended
            return await last_turns(nc, await conversations(nc) - before)
        finally:
            await nc.close()

    def leave_a_stream() -> None:
        stream = api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to a thousand."}],
            n=3,
            stream=True,
            max_tokens=4000,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        for _, _ in zip(range(6), stream, strict=False):  # the roles, then text
            pass
        stream.close()

    turns = asyncio.run(go())
    assert len(turns) == 3
    assert all(t["finish_reason"] == "cancelled" and t["completion_tokens"] < 4000 for t in turns)


def test_n_that_cannot_be_served_is_refused(server, alice, api) -> None:
    def create(**fields: Any) -> Any:
        body = {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}
        return lambda: api.chat.completions.create(**body)

    for n in (0, 17, 100):
        status, body = error_of(create(n=n))
        assert status == 400 and body["param"] == "n", body
    status, body = error_of(lambda: api.completions.create(model=MODEL, prompt="a", n=100))
    assert status == 400 and body["param"] == "n"
    # a named conversation would fork: refused, named by the field or the header
    _, named = error_of(create(n=2, extra_body={"conversation_id": "c-1"}))
    assert named["param"] == "n" and "fork" in named["message"]
    status, body = error_of(create(n=2, extra_headers={"X-Conversation-Id": "c-1"}))
    assert status == 400 and body["param"] == "n"

    # every choice's turn fails alike: one error, with its status, streamed or not, and no
    # turn left running
    async def settled() -> bool:
        nc = await nats.connect(**alice["nats"])
        try:
            return await idle(nc)
        finally:
            await nc.close()

    long = [{"role": "user", "content": "word " * 9000}]
    for stream in (False, True):
        status, body = error_of(create(messages=long, n=3, stream=stream))
        assert status == 400 and body["code"] == "context_length_exceeded"
    assert asyncio.run(settled())
