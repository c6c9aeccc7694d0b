"""Tool calling end to end, with the official `openai` client and with nats-py, against
`pensieve serve` running SmolLM2 on the CPU with a chat template that shows tools: a weather
call asked by name, its result sent back, and the next turn served from the cache; streamed
tool-call deltas add up to the whole reply."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import nats
import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from pensieve.actors.wire import subjects
from tests.ops.test_http import MODEL, Server, client
from tests.ops.tool_calling import QUESTION, RESULT, TOOLS, WEATHER, write_template

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    template = write_template(tmp_path_factory.mktemp("template"))
    running = Server(
        tmp_path_factory.mktemp("data"),
        *("--chat-template", str(template)),
        *("--gpu-cache-tokens", "1024", "--cpu-cache-tokens", "1024"),  # room for the tools
    )
    try:
        yield running
    finally:
        assert running.stop() == 0


@pytest.fixture(scope="module")
def alice(server) -> dict[str, Any]:
    return server.tenant("alice")


def test_a_named_tool_is_called_and_its_result_answered_from_the_cache(server, alice) -> None:
    api = client(server, alice)
    chat: list[Any] = [{"role": "user", "content": QUESTION}]
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat, tools=TOOLS, tool_choice=WEATHER, **GREEDY
    )
    first = raw.parse()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments.get("city"), str)
    # the client's usual round trip: the reply's message as it came, then the tool's result
    chat += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    again = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat, tools=TOOLS, **GREEDY
    )
    second = again.parse()
    assert again.headers["X-Conversation-Id"] == raw.headers["X-Conversation-Id"]
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len(RESULT) // 8
    # the first turn's prompt and its call were in the cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_deltas_add_up_to_the_whole_reply(server, alice) -> None:
    api = client(server, alice)
    chat = [{"role": "user", "content": QUESTION}]
    asked: dict[str, Any] = {"model": MODEL, "tools": TOOLS, "tool_choice": WEATHER, **GREEDY}
    whole = api.chat.completions.create(messages=chat, **asked).choices[0]
    state = ChatCompletionStreamState()
    deltas = []
    for chunk in api.chat.completions.create(messages=chat, stream=True, **asked):
        state.handle_chunk(chunk)
        deltas += [d for c in chunk.choices for d in c.delta.tool_calls or ()]
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert not streamed.message.content and not whole.message.content

    def calls(message: Any) -> list[tuple[str, str]]:
        return [(c.function.name, c.function.arguments) for c in message.tool_calls]

    assert calls(streamed.message) == calls(whole.message)
    # OpenAI's shape: the call's index, id and name first, then its arguments
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    assert (
        "".join(d.function.arguments or "" for d in deltas)
        == whole.message.tool_calls[0].function.arguments
    )


def test_the_same_round_trip_over_nats(server, alice) -> None:
    async def round_trip() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        nc = await nats.connect(**alice["nats"])
        try:

            async def ask(subject: str, body: dict[str, Any]) -> dict[str, Any]:
                answer = await nc.request(subject, orjson.dumps(body), timeout=120)
                return dict(orjson.loads(answer.data))

            body = {"message": QUESTION, "tools": TOOLS, "tool_choice": WEATHER, "max_tokens": 40}
            first = await ask(subjects.CHAT, body)
            conv_id = first["conversation_id"]
            (call,) = first["tool_calls"]
            results = [{"tool_call_id": call["id"], "content": RESULT}]
            # the stateful way: the conversation named, the tool's result its new message
            second = await ask(
                subjects.CHAT,
                {"conversation_id": conv_id, "tool_results": results, "tools": TOOLS},
            )
            got = await ask(subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
            return first, second, got
        finally:
            await nc.close()

    first, second, got = asyncio.run(round_trip())
    assert first["finish_reason"] == "tool_calls" and first["text"] == ""
    (call,) = first["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    # the turn records keep the call and the result
    turns = got["turns"]
    assert turns[0]["tool_calls"] == first["tool_calls"] and turns[0]["message"] == QUESTION
    assert turns[1]["tool_results"] == [{"tool_call_id": call["id"], "content": RESULT}]
    assert turns[1]["message"] == "" and turns[1]["text"] == second["text"]
