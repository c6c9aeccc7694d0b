"""Tool calling end to end, with the official `openai` client and with nats-py, against
`pensieve serve` running SmolLM2 on the CPU with a chat template that shows tools: a weather
call asked by name, its result sent back, and the next turn served from the cache; streamed
tool-call deltas add up to the whole reply; the same over the Responses API (function_call
items, function_call_output sent back with previous_response_id, streamed events)."""

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
from tests.ops.http_server import MODEL, Server, client, serving
from tests.ops.tool_calling import QUESTION, RESULT, TOOLS, WEATHER, write_template

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    template = write_template(tmp_path_factory.mktemp("template"))
    with serving(
        tmp_path_factory.mktemp("data"),
        *("--chat-template", str(template)),
        *("--gpu-cache-tokens", "1024", "--cpu-cache-tokens", "1024"),  # room for the tools
    ) as running:
        yield running


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
    # and what each asked: the tools, the named function, then the default choice
    assert (turns[0]["tools"], turns[0]["tool_choice"]) == (TOOLS, WEATHER)
    assert (turns[1]["tools"], turns[1]["tool_choice"]) == (TOOLS, "auto")


# the same tools as the Responses API writes them: flat, not under "function"
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
NAMED = {"type": "function", "name": "get_weather"}
RESPONSE_GREEDY = {"temperature": 0, "max_output_tokens": 40}


def _calls(response: Any) -> list[tuple[str, str, str, str]]:
    return [
        (item.type, item.name, item.arguments, item.status)
        for item in response.output
        if item.type == "function_call"
    ]


def test_a_named_function_is_called_over_responses_and_its_output_answered_from_the_cache(
    server, alice
) -> None:
    api = client(server, alice)
    first = api.responses.create(
        model=MODEL, input=QUESTION, tools=RESPONSE_TOOLS, tool_choice=NAMED, **RESPONSE_GREEDY
    )
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert isinstance(json.loads(call.arguments).get("city"), str)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    second = api.responses.create(
        model=MODEL,
        input=[output],
        previous_response_id=first.id,
        tools=RESPONSE_TOOLS,
        **RESPONSE_GREEDY,
    )
    assert second.conversation and first.conversation
    assert second.conversation.id == first.conversation.id
    assert first.usage and second.usage
    assert second.usage.input_tokens > first.usage.input_tokens + len(RESULT) // 8
    # the first turn's prompt and its call were in the cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # the stored responses keep the call, the tools and the choice
    again = api.responses.retrieve(first.id)
    assert _calls(again) == _calls(first)
    assert [tool.name for tool in again.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert again.tool_choice.type == "function" and again.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    (added,) = api.responses.input_items.list(second.id)
    assert (added.type, added.call_id, added.output) == (
        "function_call_output",
        call.call_id,
        RESULT,
    )  # type: ignore[union-attr]


def test_streamed_response_events_add_up_to_the_whole_call(server, alice) -> None:
    api = client(server, alice)
    asked: dict[str, Any] = {
        "model": MODEL,
        "input": QUESTION,
        "tools": RESPONSE_TOOLS,
        "tool_choice": NAMED,
        **RESPONSE_GREEDY,
    }
    whole = api.responses.create(**asked)
    events = list(api.responses.create(stream=True, **asked))
    added, arguments, done = {}, {}, {}
    for event in events:
        if event.type == "response.output_item.added":
            added[event.output_index] = event.item
            arguments[event.output_index] = ""
        elif event.type == "response.function_call_arguments.delta":
            arguments[event.output_index] += event.delta
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == arguments[event.output_index]
        elif event.type == "response.output_item.done":
            done[event.output_index] = event.item
    assert [e.type for e in events[:3]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ]
    assert events[-1].type == "response.completed"
    streamed = events[-1].response  # type: ignore[union-attr]
    assert _calls(streamed) == _calls(whole) and len(_calls(whole)) == 1
    (index,) = done
    assert added[index].arguments == "" and added[index].status == "in_progress"  # type: ignore[union-attr]
    assert arguments[index] == done[index].arguments == _calls(whole)[0][2]  # type: ignore[union-attr]
    # the client's own stream helper follows the events to the same response
    with api.responses.stream(**asked) as stream:
        assert _calls(stream.get_final_response()) == _calls(whole)
