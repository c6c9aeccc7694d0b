"""The Responses and Conversations APIs' translation (no I/O): response ids, requests, the chat
a turn is sent with, item pages and the numbering of streamed events."""

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
        events.delta("Hel"),
        events.delta("lo"),
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
