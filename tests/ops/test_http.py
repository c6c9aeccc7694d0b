"""`pensieve serve --http-port` end to end with the official `openai` client: a real server
process with its nats-server and accounts, tenants made by `pensieve tenant add`, the real
SmolLM2 on the CPU."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import nats
import openai
import orjson
import pytest
from openai import OpenAI

from pensieve.actors.ingress.http_actor import MAX_BODY_BYTES
from pensieve.actors.wire import subjects
from tests.ops.http_server import MODEL, Server, client, serving
from tests.ops.tool_calling import TOOLS

pytestmark = pytest.mark.slow

CHAT = ["What is the capital of France?", "And of Italy?"]
GREEDY = {"temperature": 0, "max_tokens": 24}
TOKEN_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("data")) as running:
        yield running


@pytest.fixture(scope="module")
def alice(server) -> dict[str, Any]:
    return server.tenant("alice")


@pytest.fixture(scope="module")
def bob(server) -> dict[str, Any]:
    return server.tenant("bob")


def ask(api: OpenAI, content: str, conv_id: str | None = None, **extra: Any) -> tuple[Any, str]:
    """One whole reply and its conversation's id (from the response header)."""
    headers = {} if conv_id is None else {"X-Conversation-Id": conv_id}
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        extra_headers=headers,
        extra_body=extra,
        **GREEDY,
    )
    return raw.parse(), raw.headers["X-Conversation-Id"]


def ask_streamed(
    api: OpenAI, messages: list[dict[str, str]], conv_id: str, **extra: Any
) -> tuple[str, Any, list[int], str]:
    """One streamed reply: its text, usage, token ids and the conversation named in the
    response header."""
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"conversation_id": conv_id, **extra},
        **GREEDY,
    )
    text, usage, ids = "", None, []
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += (choice.model_extra or {}).get("token_ids") or []
    return text, usage, ids, raw.headers["X-Conversation-Id"]


def test_a_conversation_over_http_reuses_its_kv(server, alice) -> None:
    api = client(server, alice)
    first, conv_id = ask(api, CHAT[0])
    assert first.choices[0].message.content and first.usage.prompt_tokens_details.cached_tokens == 0
    # the next message alone, the conversation named: streamed, its prompt served from the cache
    text, usage, _, named = ask_streamed(api, [{"role": "user", "content": CHAT[1]}], conv_id)
    assert named == conv_id and text
    assert usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0
    # a stateless client resends the whole chat: the same cache hit, the same reply
    history = [
        {"role": "user", "content": CHAT[0]},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": CHAT[1]},
    ]
    again = api.chat.completions.create(
        model=MODEL, messages=history, **GREEDY, extra_body={"conversation_id": conv_id}
    )
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens == usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_a_client_that_names_no_conversation_still_hits_its_kv(server, alice, bob) -> None:
    """The plain OpenAI way: the whole chat every time, no conversation named."""
    api = client(server, alice)
    chat = [{"role": "user", "content": "Name a colour."}]
    first = api.chat.completions.with_raw_response.create(model=MODEL, messages=chat, **GREEDY)
    chat.append({"role": "assistant", "content": first.parse().choices[0].message.content})
    chat.append({"role": "user", "content": "And another one?"})
    second = api.chat.completions.with_raw_response.create(model=MODEL, messages=chat, **GREEDY)
    assert second.headers["X-Conversation-Id"] == first.headers["X-Conversation-Id"]
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 0
    # another tenant's identical chat is a conversation of its own, with nothing cached
    theirs = client(server, bob).chat.completions.with_raw_response.create(
        model=MODEL, messages=chat, **GREEDY
    )
    assert theirs.headers["X-Conversation-Id"] != first.headers["X-Conversation-Id"]
    assert theirs.parse().usage.prompt_tokens_details.cached_tokens == 0

    async def delete(conv_id: str) -> None:
        nc = await nats.connect(**alice["nats"])
        body = orjson.dumps({"conversation_id": conv_id})
        await nc.request(subjects.CONVERSATIONS_DELETE, body, timeout=30)
        await nc.close()

    # the conversation gone, the chat goes on in a new one
    asyncio.run(delete(second.headers["X-Conversation-Id"]))
    chat += [
        {"role": "assistant", "content": second.parse().choices[0].message.content},
        {"role": "user", "content": "A third?"},
    ]
    third = api.chat.completions.with_raw_response.create(model=MODEL, messages=chat, **GREEDY)
    assert third.headers["X-Conversation-Id"] != second.headers["X-Conversation-Id"]
    assert third.parse().choices[0].message.content


def test_greedy_tokens_equal_those_of_the_nats_api(server, alice) -> None:
    api = client(server, alice)
    whole, conv_id = ask(api, CHAT[0], **TOKEN_IDS)
    text, _, streamed_ids, _ = ask_streamed(
        api, [{"role": "user", "content": CHAT[1]}], conv_id, **TOKEN_IDS
    )
    over_http = [whole.choices[0].model_extra["token_ids"], streamed_ids]

    async def over_nats() -> list[dict[str, Any]]:
        nc = await nats.connect(**alice["nats"])
        try:
            replies: list[dict[str, Any]] = []
            body: dict[str, Any] = {"message": CHAT[0], "max_tokens": GREEDY["max_tokens"]}
            for message in CHAT:
                if replies:
                    body = {
                        **body,
                        "message": message,
                        "conversation_id": replies[0]["conversation_id"],
                    }
                answer = await nc.request(subjects.CHAT, orjson.dumps(body), timeout=120)
                replies.append(orjson.loads(answer.data))
            return replies
        finally:
            await nc.close()

    replies = asyncio.run(over_nats())
    assert over_http == [reply["token_ids"] for reply in replies]
    assert text == replies[1]["text"]


def test_completions_of_a_raw_prompt_equal_those_of_the_nats_api(server, alice) -> None:
    """`/v1/completions` (what `vllm bench serve` drives by default): the prompt completed as it
    is, whole and streamed, with the tokens of a `prompt` request over NATS."""
    api, prompt = client(server, alice), "The three primary colors are"
    whole = api.completions.create(model=MODEL, prompt=prompt, extra_body=TOKEN_IDS, **GREEDY)
    assert whole.object == "text_completion" and whole.choices[0].text
    text, usage, ids = "", None, []
    for chunk in api.completions.create(
        model=MODEL,
        prompt=prompt,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=TOKEN_IDS,
        **GREEDY,
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            ids += (choice.model_extra or {}).get("token_ids") or []
    assert text == whole.choices[0].text and ids == whole.choices[0].model_extra["token_ids"]
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens

    async def over_nats() -> dict[str, Any]:
        nc = await nats.connect(**alice["nats"])
        try:
            body = {"prompt": prompt, "max_tokens": GREEDY["max_tokens"]}
            return dict(
                orjson.loads(
                    (await nc.request(subjects.CHAT, orjson.dumps(body), timeout=120)).data
                )
            )
        finally:
            await nc.close()

    reply = asyncio.run(over_nats())
    assert ids == reply["token_ids"] and text == reply["text"]
    # OpenAI's default length of a completion; a batch of prompts or `echo` is refused
    default = api.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16
    status, body = error_of(lambda: api.completions.create(model=MODEL, prompt=[prompt, "Hi"]))
    assert status == 400 and body["param"] == "prompt"
    status, body = error_of(lambda: api.completions.create(model=MODEL, prompt=prompt, echo=True))
    assert status == 400 and body["param"] == "echo"


def error_of(call: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    body = raised.value.body
    assert isinstance(body, dict) and {"message", "type", "code"} <= set(body), body
    return raised.value.status_code, body


def test_bad_requests_get_openai_errors_with_their_status(server, alice) -> None:
    api = client(server, alice)
    user = [{"role": "user", "content": "Hi"}]

    def create(**fields: Any) -> Any:
        return lambda: api.chat.completions.create(**{"model": MODEL, "messages": user, **fields})

    status, body = error_of(create(model="gpt-4"))
    assert status == 404 and body["code"] == "model_not_found"
    status, body = error_of(create(messages=[]))
    assert status == 400 and body["type"] == "invalid_request_error"
    for n in (0, 100, 1.5):  # several choices are served (`test_http_choices.py`), a few
        status, body = error_of(create(n=n))
        assert status == 400 and body["param"] == "n"
    status, body = error_of(create(temperature=-1))  # checked by the NATS ingress
    assert status == 400 and "temperature" in body["message"]
    # SmolLM2's own chat template shows no tools (`test_tool_calling.py` serves one that does)
    status, body = error_of(create(tools=TOOLS))
    assert status == 400 and "does not show tools" in body["message"]
    status, body = error_of(create(tools=TOOLS, tool_choice="required"))  # (a grammar's)
    assert status == 400 and "does not show tools" in body["message"]
    _, conv_id = ask(api, "Hi")
    missing = conv_id[:-4] + ("0000" if not conv_id.endswith("0000") else "1111")
    status, body = error_of(create(extra_body={"conversation_id": missing}))
    assert status == 404 and body["code"] == "not_found"
    long = [{"role": "user", "content": "word " * 9000}]
    status, body = error_of(create(messages=long, max_tokens=4))
    assert status == 400 and body["code"] == "context_length_exceeded"
    nobody = OpenAI(base_url=server.base_url, api_key="pk-wrong", max_retries=0)
    status, body = error_of(lambda: nobody.models.list())
    assert status == 401 and body["code"] == "invalid_api_key"
    for path, data in (("/chat/completions", b"{not json"), ("/completions", b"{}")):
        request = urllib.request.Request(
            server.base_url + path,
            data=data,
            headers={"Authorization": f"Bearer {alice['http']['api_key']}"},
        )
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=30)
        assert raised.value.code in (400, 404)
        assert set(json.loads(raised.value.read())["error"]) >= {"message", "type", "code"}


def test_a_tenants_key_does_not_reach_another_tenants_conversation(server, alice, bob) -> None:
    _, conv_id = ask(client(server, alice), "Hello")
    intruder = client(server, bob)
    status, body = error_of(lambda: ask(intruder, "Tell me everything", conv_id))
    assert status == 404 and body["code"] == "not_found"
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Mine now"},
    ]
    status, _ = error_of(lambda: ask_streamed(intruder, history, conv_id))
    assert status == 404
    # alice's conversation goes on as she left it
    reply, named = ask(client(server, alice), "Still there?", conv_id)
    assert named == conv_id and reply.usage.prompt_tokens_details.cached_tokens > 0


def test_models_health_and_version(server, alice) -> None:
    (card,) = client(server, alice).models.list()
    # SmolLM2's context of 8192 tokens, cut to the 256-token GPU tier, as the log says
    assert card.id == MODEL and card.model_extra["max_model_len"] == 256
    assert any("(8192 tokens)" in line and "limited to 256" in line for line in server.lines)
    root = f"http://127.0.0.1:{server.http_port}"
    with urllib.request.urlopen(f"{root}/health", timeout=30) as up:
        assert up.status == 200
    with urllib.request.urlopen(f"{root}/version", timeout=30) as answer:
        assert json.loads(answer.read())["version"]


def test_a_client_that_leaves_a_stream_cancels_its_turn(server, alice) -> None:
    api = client(server, alice)
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to a thousand."}],
        stream=True,
        max_tokens=4000,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    conv_id = raw.headers["X-Conversation-Id"]
    stream = raw.parse()
    for _, _ in zip(range(3), stream, strict=False):  # the role, then text
        pass
    stream.close()

    async def last_turn() -> dict[str, Any]:
        nc = await nats.connect(**alice["nats"])
        try:
            body = orjson.dumps({"conversation_id": conv_id})
            for _ in range(300):
                got = orjson.loads(
                    (await nc.request(subjects.CONVERSATIONS_GET, body, timeout=30)).data
                )
                if got.get("turns") and not got["busy"]:  # a new one is stored at its end
                    return dict(got["turns"][-1])
                await asyncio.sleep(0.1)
            raise AssertionError("the turn did not end")
        finally:
            await nc.close()

    turn = asyncio.run(last_turn())
    assert turn["finish_reason"] == "cancelled" and turn["completion_tokens"] < 4000


async def stats_of(nc: Any) -> dict[str, Any]:
    return dict(orjson.loads((await nc.request(subjects.STATS, b"{}", timeout=30)).data))


def test_a_client_that_leaves_before_its_whole_reply_cancels_its_turn(server, alice) -> None:
    """Not streamed: the turn ends within a second of the client closing its connection,
    committed as cancelled with what it generated, and the conversation goes on from it."""
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 4000,
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {alice['http']['api_key']}\r\nContent-Length: {len(body)}\r\n\r\n"
    )

    async def go() -> tuple[float, list[str]]:
        nc = await nats.connect(**alice["nats"])
        try:
            listed = {"limit": 1000}
            before = orjson.loads(
                (await nc.request(subjects.CONVERSATIONS_LIST, orjson.dumps(listed), 30)).data
            )
            _, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
            writer.write(head.encode() + body)
            while (await stats_of(nc))["requests"]["running"] == 0:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # it generates
            writer.close()  # the client leaves
            begin = time.monotonic()
            while True:
                stats = await stats_of(nc)
                idle = stats["turns_in_flight"] == stats["requests"]["running"] == 0
                if idle or time.monotonic() - begin > 30:
                    break
                await asyncio.sleep(0.05)
            took = time.monotonic() - begin
            after = orjson.loads(
                (await nc.request(subjects.CONVERSATIONS_LIST, orjson.dumps(listed), 30)).data
            )
            return took, sorted(set(after["conversations"]) - set(before["conversations"]))
        finally:
            await nc.close()

    took, made = asyncio.run(go())
    assert took < 1.0
    (conv_id,) = made

    async def turns() -> list[dict[str, Any]]:
        nc = await nats.connect(**alice["nats"])
        try:
            got = await nc.request(
                subjects.CONVERSATIONS_GET, orjson.dumps({"conversation_id": conv_id}), 30
            )
            return list(orjson.loads(got.data)["turns"])
        finally:
            await nc.close()

    (turn,) = asyncio.run(turns())
    assert turn["finish_reason"] == "cancelled" and 0 < turn["completion_tokens"] < 4000
    # the conversation goes on from the cancelled turn, its KV reused
    reply, named = ask(client(server, alice), "Stop.", conv_id)
    assert named == conv_id and reply.usage.prompt_tokens_details.cached_tokens > 0


def test_a_body_near_the_size_limit_is_refused_and_the_next_request_answered(server, alice) -> None:
    """A body under the HTTP limit (1 MiB) that does not fit a NATS message once the ingress
    adds its fields is refused as too long, in OpenAI's shape; the engine stays on the bus."""
    key = alice["http"]["api_key"]
    empty = len(orjson.dumps({"messages": [{"role": "user", "content": ""}], "temperature": 0}))
    for slack in (1, 200, 3000):
        content = "x" * (MAX_BODY_BYTES - slack - empty)
        data = orjson.dumps({"messages": [{"role": "user", "content": content}], "temperature": 0})
        assert len(data) == MAX_BODY_BYTES - slack
        request = urllib.request.Request(
            server.base_url + "/chat/completions",
            data=data,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=60)
        error = json.loads(raised.value.read())["error"]
        assert raised.value.code == 400 and error["code"] == "context_length_exceeded", error
        assert error["type"] == "invalid_request_error" and error["message"]
    reply, _ = ask(client(server, alice), CHAT[0])
    assert reply.choices[0].message.content


REUSED = ("gpu", "cpu", "disk")  # the tiers whose tokens `cached_tokens` counts
SOURCES = {"gpu", "cpu", "disk", "recomputed", "new", "shared"}


def check_cached(cached: Any, sources: dict[str, int], prompt_tokens: int) -> None:
    """`cached_tokens` is one number, the reused tiers' tokens of the sources beside it, which
    (with `recomputed` and `new`; `shared` is of `gpu` and `cpu`) add up to the prompt."""
    assert type(cached) is int and set(sources) == SOURCES, (cached, sources)
    assert cached == sum(sources[k] for k in REUSED) > 0, (cached, sources)
    assert cached + sources["recomputed"] + sources["new"] == prompt_tokens, sources
    assert sources["shared"] <= sources["gpu"] + sources["cpu"]


def test_cached_tokens_is_one_number_everywhere_with_its_tiers_beside_it(server, alice) -> None:
    """A second turn with reuse, over NATS (its reply and `conversations.get`'s turn), chat
    completions and the Responses API."""

    async def over_nats() -> tuple[dict[str, Any], dict[str, Any]]:
        nc = await nats.connect(**alice["nats"])
        try:
            body = {"message": "Name a planet.", "max_tokens": 8}
            first = orjson.loads((await nc.request(subjects.CHAT, orjson.dumps(body), 120)).data)
            body = {**body, "message": "And a moon?", "conversation_id": first["conversation_id"]}
            second = orjson.loads((await nc.request(subjects.CHAT, orjson.dumps(body), 120)).data)
            get = orjson.dumps({"conversation_id": first["conversation_id"]})
            stored = orjson.loads((await nc.request(subjects.CONVERSATIONS_GET, get, 30)).data)
            return second, stored["turns"][1]
        finally:
            await nc.close()

    second, stored = asyncio.run(over_nats())
    usage = second["usage"]
    check_cached(usage["cached_tokens"], usage["prompt_sources"], usage["prompt_tokens"])
    assert (stored["cached_tokens"], stored["prompt_sources"]) == (
        usage["cached_tokens"],
        usage["prompt_sources"],
    )
    api = client(server, alice)
    _, conv_id = ask(api, "Name a river.")
    reply, _ = ask(api, "And a lake?", conv_id)
    details = reply.usage.prompt_tokens_details
    check_cached(
        details.cached_tokens, details.model_extra["prompt_sources"], reply.usage.prompt_tokens
    )
    first = api.responses.create(model=MODEL, input="Name a tree.", max_output_tokens=16)
    later = api.responses.create(
        model=MODEL, input="And a flower?", previous_response_id=first.id, max_output_tokens=16
    )
    assert later.usage is not None
    details = later.usage.input_tokens_details
    check_cached(
        details.cached_tokens, details.model_extra["prompt_sources"], later.usage.input_tokens
    )
    stored_response = api.responses.retrieve(later.id)
    assert stored_response.usage is not None
    assert stored_response.usage.input_tokens_details.model_dump() == details.model_dump()


def test_vllms_top_k_and_min_p_cut_the_tail_and_their_no_op_values_change_nothing(
    server, alice
) -> None:
    api = client(server, alice)
    user = [{"role": "user", "content": CHAT[0]}]

    def token_ids(extra: dict[str, Any] | None = None, **fields: Any) -> list[int]:
        reply = api.chat.completions.create(
            model=MODEL,
            messages=user,
            max_tokens=12,
            extra_body={**TOKEN_IDS, **(extra or {})},
            **fields,
        )
        return list(reply.choices[0].model_extra["token_ids"])

    greedy = token_ids(temperature=0)
    # hot, but only the likeliest token is left to draw
    assert token_ids({"top_k": 1}, temperature=1.5, seed=1) == greedy
    assert token_ids({"min_p": 0.999}, temperature=1.5, seed=2) == greedy
    # vLLM's "every token" values draw what a request without them draws
    plain = token_ids(temperature=1.0, seed=3)
    assert token_ids({"top_k": -1, "min_p": 0}, temperature=1.0, seed=3) == plain
    status, body = error_of(lambda: token_ids({"top_k": -5}))
    assert status == 400 and "top_k" in body["message"]
    status, body = error_of(lambda: token_ids({"min_p": 1.5}))
    assert status == 400 and "min_p" in body["message"]


def test_penalties_and_logit_bias_change_greedy_replies_and_bad_values_are_refused(
    server, alice
) -> None:
    api = client(server, alice)
    user = [{"role": "user", "content": "Repeat the word 'yes' ten times."}]

    def token_ids(**fields: Any) -> list[int]:
        reply = api.chat.completions.create(
            model=MODEL, messages=user, max_tokens=16, temperature=0, extra_body=TOKEN_IDS, **fields
        )
        return list(reply.choices[0].model_extra["token_ids"])

    plain = token_ids()
    assert token_ids(presence_penalty=0, frequency_penalty=0, logit_bias={}) == plain
    banned = plain[0]
    biased = token_ids(logit_bias={str(banned): -100})
    assert banned not in biased
    repeated = max(set(plain), key=plain.count)
    assert plain.count(repeated) > 1
    penalized = token_ids(frequency_penalty=2.0)
    assert penalized != plain and penalized.count(repeated) < plain.count(repeated)
    for bad in (
        {"frequency_penalty": 3},
        {"presence_penalty": -2.5},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"1": 101}},
        {"logit_bias": {str(10**8): 1}},  # past the vocabulary
    ):
        status, body = error_of(lambda bad=bad: token_ids(**bad))
        assert status == 400 and next(iter(bad)) in body["message"], (bad, body)


def test_vllms_min_tokens_holds_back_the_end_and_goes_with_no_stop_strings(server, alice) -> None:
    api = client(server, alice)
    user = [{"role": "user", "content": "Answer with one word: is water wet?"}]

    def reply(max_tokens: int = 24, **extra: Any) -> Any:
        return api.chat.completions.create(
            model=MODEL, messages=user, max_tokens=max_tokens, temperature=0, extra_body=extra
        )

    short = reply()
    assert short.usage.completion_tokens < 16 and short.choices[0].finish_reason == "stop"
    held = reply(min_tokens=16)
    assert held.usage.completion_tokens >= 16
    status, body = error_of(lambda: reply(max_tokens=8, min_tokens=16))
    assert status == 400 and body["param"] == "min_tokens"
    status, body = error_of(lambda: reply(min_tokens=4, stop=["."]))
    assert status == 400 and body["param"] == "min_tokens"
