"""The Responses and Conversations APIs' translation (no I/O): response ids, requests, the chat
a turn is sent with, function tools and their calls and results, item pages and the streamed
events."""

from __future__ import annotations

import orjson
import pytest

from pensieve.actors.ingress import conversation_items, responses
from pensieve.actors.ingress.openai_api import OpenAIError
from pensieve.actors.ingress.response_events import ResponseEvents
from pensieve.actors.ingress.responses import ResponseRef

USER = {"role": "user", "content": "Hi"}


def request(**body: object) -> responses.ResponsesRequest:
    return responses.to_request(orjson.dumps({"input": "Hi", **body}), "m")


def test_a_response_id_names_its_turn_and_conversation() -> None:
    ref = ResponseRef("c-0123abcd-ff_x", 12)
    assert responses.parse_response_id(ref.id) == ref
    for bad in ("resp_x_c", "resp_1_", "c-0123abcd-ff", "resp_99999999999_c"):
        with pytest.raises(OpenAIError) as refused:
            responses.parse_response_id(bad)
        assert refused.value.status == 404


def test_instructions_replace_the_head_system_message_and_the_input_ends_with_the_user() -> None:
    context = [{"role": "system", "content": "old"}, USER, {"role": "assistant", "content": "Yo"}]
    chat = responses.with_input(context, request(instructions="new"))
    assert chat == [{"role": "system", "content": "new"}, *context[1:], USER]
    assert responses.with_input(context, request()) == [*context, USER]
    assert responses.next_turn("c", context, [*context, USER]) == {
        "conversation_id": "c",
        "message": "Hi",
    }
    edited = [{"role": "system", "content": "new"}, *context[1:], USER]
    assert responses.next_turn("c", context, edited) == {"conversation_id": "c", "messages": edited}
    with pytest.raises(OpenAIError) as refused:
        responses.with_input([], request(input=[{"role": "assistant", "content": "x"}]))
    assert refused.value.param == "input"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"metadata": {"k": "v"}}, "metadata"),
        ({"text": "json"}, "text"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"previous_response_id": "resp_0_c", "conversation": "c"}, "previous_response_id"),
        ({"conversation": "c", "store": False}, "store"),
        ({"store": "no"}, "store"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        request(**body)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_text_format_asks_the_client_apis_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "r", "schema": schema, "strict": True}
    asked = request(text={"format": fmt})
    assert asked.sampling["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": schema, "strict": True},
    }
    shown = responses.response(ResponseRef("c-0123abcd-ff_x", 1), asked, "m", None)
    assert shown["text"] == {"format": fmt}
    assert request(text={"format": {"type": "json_object"}}).sampling["response_format"] == {
        "type": "json_object"
    }
    assert "response_format" not in request(text={"format": {"type": "text"}}).sampling


def test_a_chat_is_rebuilt_from_its_turns_and_their_history() -> None:
    turns = [
        {"message": "a", "text": "b", "history": None},
        {"message": "c", "text": "d", "history": [{"role": "system", "content": "s"}]},
    ]
    opening = [{"role": "system", "content": "o"}]
    assert responses.chat_until(opening, turns, -1) == opening
    assert [m["content"] for m in responses.chat_until(opening, turns, 0)] == ["o", "a", "b"]
    assert [m["content"] for m in responses.chat_until(opening, turns, 1)] == ["s", "c", "d"]


def test_items_page_in_either_order_after_an_item() -> None:
    chat = [{"role": "user", "content": str(i)} for i in range(5)]
    first = conversation_items.page(chat, {"limit": "2", "order": "asc"})
    assert [i["id"] for i in first["data"]] == ["msg_0", "msg_1"] and first["has_more"]
    rest = conversation_items.page(chat, {"after": first["last_id"], "order": "asc"})
    assert [i["id"] for i in rest["data"]] == ["msg_2", "msg_3", "msg_4"] and not rest["has_more"]
    assert conversation_items.page(chat, {"limit": "1"})["first_id"] == "msg_4"
    for bad in ({"limit": "0"}, {"limit": "x"}, {"order": "up"}, {"after": "msg_9"}):
        with pytest.raises(OpenAIError):
            conversation_items.page(chat, bad)


def test_streamed_events_are_numbered_in_order() -> None:
    ref = ResponseRef("c", 0)
    asked = request()
    events = ResponseEvents(ref, responses.response(ref, asked, "m", None))
    reply = {
        "text": "Hello",
        "finish_reason": "length",
        "usage": responses.token_usage(3, 2, 1, {"gpu": 1, "new": 2}),
    }
    sent = [
        *events.opening(),
        *events.delta("Hel"),
        *events.delta("lo"),
        *events.closing(responses.response(ref, asked, "m", reply)),
    ]
    bodies = [orjson.loads(event.split(b"data: ", 1)[1]) for event in sent]
    assert [b["sequence_number"] for b in bodies] == list(range(len(sent)))
    assert bodies[-1]["type"] == "response.incomplete"
    assert bodies[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert all(
        e.startswith(b"event: " + b["type"].encode() + b"\n")
        for e, b in zip(sent, bodies, strict=True)
    )


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def test_flat_function_tools_and_a_named_choice_ask_the_client_apis_tools() -> None:
    asked = request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    function = {k: v for k, v in WEATHER.items() if k != "type"}
    assert asked.sampling["tools"] == [{"type": "function", "function": function}]
    assert asked.sampling["tool_choice"] == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    shown = responses.response(ResponseRef("c", 0), asked, "m", None)
    assert shown["tools"] == [WEATHER]
    assert shown["tool_choice"] == {"type": "function", "name": "get_weather"}
    # no tools: a choice that needs none is dropped, as before tools were supported
    assert "tool_choice" not in request(tool_choice="auto").sampling
    assert request(tools=[WEATHER]).sampling.get("tool_choice") is None
    for bad in ({"tool_choice": "sometimes"}, {"tools": [{**WEATHER, "extra": 1}]}):
        with pytest.raises(OpenAIError) as refused:
            request(**bad)
        assert refused.value.param == next(iter(bad))


def test_function_call_items_and_their_outputs_are_the_chats_calls_and_results() -> None:
    call = {"type": "function_call", "call_id": "call_1", **CALL["function"]}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    items = responses.input_items([USER, call, output], "input")
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert items == [USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}, result]
    # the next turn of the conversation whose reply made the call: the result alone
    context = items[:2]
    chat = responses.with_input(context, request(input=[output]))
    assert chat == items
    assert responses.next_turn("c", context, chat) == {
        "conversation_id": "c",
        "tool_results": [{"tool_call_id": "call_1", "content": "sunny"}],
    }
    assert responses.last_sent(chat) == 1 and responses.last_sent([*chat, USER]) == 2


def test_a_chat_is_rebuilt_with_its_turns_calls_and_results() -> None:
    turns = [
        {"message": "Weather?", "text": "", "tool_calls": [CALL]},
        {
            "message": "",
            "text": "Sunny.",
            "tool_results": [{"tool_call_id": "call_1", "content": "s"}],
        },
    ]
    assert responses.chat_until([], turns, 1) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "s"},
        {"role": "assistant", "content": "Sunny."},
    ]
    page = conversation_items.page(responses.chat_until([], turns, 1), {"order": "asc"})
    kinds = [(item["type"], item["id"]) for item in page["data"]]
    assert kinds == [
        ("message", "msg_0"),
        ("function_call", "fc_1_0"),
        ("function_call_output", "fco_2"),
        ("message", "msg_3"),
    ]


def test_a_reply_that_calls_a_function_is_a_function_call_item_streamed_as_openai_does() -> None:
    ref = ResponseRef("c", 2)
    asked = request(tools=[WEATHER], tool_choice="required")
    reply = {
        "text": "",
        "finish_reason": "tool_calls",
        "tool_calls": [CALL],
        "usage": responses.token_usage(3, 2, 1, {"gpu": 1, "new": 2}),
    }
    finished = responses.response(ref, asked, "m", reply)
    assert finished["status"] == "completed"
    assert finished["output"] == [
        {
            "type": "function_call",
            "id": "fc_2_0_c",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        }
    ]
    events = ResponseEvents(ref, responses.response(ref, asked, "m", None))
    sent = [*events.opening(), *events.closing(finished)]
    bodies = [orjson.loads(event.split(b"data: ", 1)[1]) for event in sent]
    assert [b["type"] for b in bodies] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done = bodies[2:5]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == CALL["function"]["arguments"]
    assert delta["item_id"] == done["item_id"] == "fc_2_0_c" and done["output_index"] == 0


def test_a_text_formats_error_names_the_responses_field() -> None:
    refused = OpenAIError(
        400,
        "response_format.json_schema.schema: not a grammar",
        "invalid_request_error",
        "invalid_request",
        "response_format.json_schema.schema",
    )
    shown = responses.in_request_terms(refused)
    assert (shown.param, shown.message) == (
        "text.format.schema",
        "text.format.schema: not a grammar",
    )
