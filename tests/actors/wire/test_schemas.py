"""The client API's parsing: a body is checked once by the ingress, handed on as encoded, and
read back by the scheduler as the same request; a bad body is refused with a message that
names what is wrong."""

from __future__ import annotations

import json

import orjson
import pytest

from pensieve.actors.wire.request_parsing import (
    encode_body,
    parse_chat,
    parse_get,
    parse_list,
    read_checked,
)
from pensieve.actors.wire.schemas import ApiError, ChatRequest, GetRequest, Page

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
GOOD = [
    {"message": "hi"},
    {"message": "hi", "stop": "x", "seed": 7, "temperature": 0.5, "top_p": 0.9, "stream": True},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    {"prompt": [1, 2, 3], "timeout_s": 5},
    {"prompt": "Once upon", "max_tokens": 3},
    {"conversation_id": "c-1234abcd-ff", "message": "again", "final": True},
    {"conversation_id": "c-1234abcd-ff", "message": "again", "turn": 3},
    {"message": "hi", "tools": TOOLS, "tool_choice": WEATHER},
    {
        "messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ],
        "tools": TOOLS,
    },
    {"conversation_id": "c-1", "tool_results": [{"tool_call_id": "c1", "content": "sunny"}]},
]


@pytest.mark.parametrize("body", GOOD)
def test_a_checked_request_reaches_the_scheduler_as_the_ingress_read_it(body) -> None:
    request = parse_chat(orjson.dumps(body))
    assert read_checked(encode_body(request), ChatRequest) == request


def test_the_checked_request_is_normalized() -> None:
    request = parse_chat(orjson.dumps({"message": "hi", "stop": "x", "temperature": 1}))
    assert request.stop == ("x",) and request.max_tokens == 256
    assert isinstance(request.temperature, float)
    assert parse_chat(orjson.dumps({"prompt": [5]})).final  # a raw completion is one turn
    chat = parse_chat(orjson.dumps({"messages": [{"role": "user", "content": "u"}]}))
    assert chat.messages == ({"role": "user", "content": "u"},)
    assert chat.tool_choice == "none"  # no tools: nothing to call
    tools = parse_chat(orjson.dumps({"message": "hi", "tools": TOOLS}))
    assert tools.tool_choice == "auto" and tools.tools == tuple(TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = parse_chat(orjson.dumps({"message": "hi", "tools": TOOLS, "tool_choice": named}))
    assert forced.tool_name == "get_weather"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"message": "\xc3\x28"}', "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "JSON object"),
        (b'{"message": "hi", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}", "'stop'"),
        (b"", "exactly one"),
        (json.dumps({"message": "hi", "seed": 2**64}).encode(), "'seed'"),
        (json.dumps({"message": "hi", "max_tokens": 10**400}).encode(), "'max_tokens'"),
        (orjson.dumps({"message": None}), "'message'"),
        (orjson.dumps({"message": "hi", "top_p": 0}), "'top_p'"),
        (orjson.dumps({"message": "hi", "ignore_eos": 1}), "'ignore_eos'"),
        (orjson.dumps({"message": "hi", "timeout_s": 0}), "'timeout_s'"),
        (orjson.dumps({"message": "hi", "stop": [""]}), "'stop'"),
        (orjson.dumps({"message": "hi", "stop": ["a"] * 9}), "'stop'"),
        (orjson.dumps({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role"),
        (orjson.dumps({"messages": [{"role": "tool", "content": "x"}]}), "'tool_call_id'"),
        (orjson.dumps({"message": "hi", "tools": [{"type": "function"}]}), "'tools'"),
        (orjson.dumps({"message": "hi", "tool_choice": "required"}), "needs 'tools'"),
        (
            orjson.dumps(
                {
                    "message": "hi",
                    "tool_choice": "required",
                    "tools": TOOLS,
                    "response_format": {"type": "json_object"},
                }
            ),
            "give one",
        ),
        (orjson.dumps({"message": "hi", "response_format": {"type": "xml"}}), "'response_format'"),
        (
            orjson.dumps({"message": "hi", "response_format": {"type": "json_schema"}}),
            "response_format.json_schema: required",
        ),
        (
            orjson.dumps(
                {
                    "message": "hi",
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                    },
                }
            ),
            "response_format.json_schema.schema: not a grammar",
        ),
        (
            orjson.dumps({"message": "hi", "response_format": {"type": "regex", "regex": "(a"}}),
            "response_format.regex: not a grammar",
        ),
        (
            orjson.dumps({"message": "hi", "tool_choice": NAMED, "tools": TOOLS}),
            "none of 'tools'",
        ),
        (orjson.dumps({"message": "hi", "tool_choice": "auto"}), "needs 'tools'"),
        (orjson.dumps({"prompt": "hi", "tools": TOOLS}), "'prompt'"),
        (
            orjson.dumps({"tool_results": [{"tool_call_id": "a", "content": "b"}]}),
            "give its id",
        ),
        (orjson.dumps({"messages": [{"role": "user", "content": 1}]}), "messages[0].content"),
        (orjson.dumps({"messages": [{"role": "user"}]}), "messages[0].content must be"),
        (orjson.dumps({"messages": []}), "non-empty array"),
        (orjson.dumps({"prompt": [-1]}), "token ids"),
        (orjson.dumps({"conversation_id": "", "message": "hi"}), "empty"),
        (orjson.dumps({"conversation_id": 3, "message": "hi"}), "'conversation_id'"),
        (orjson.dumps({"message": "hi", "colour": 1}), "unknown field(s): colour"),
        (orjson.dumps({"conversation_id": "c", "message": "hi", "turn": -1}), "'turn'"),
        (orjson.dumps({"message": "hi", "turn": 2}), "first turn is turn 0"),
    ],
)
def test_a_bad_chat_body_is_refused_with_what_is_wrong(data: bytes, says: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_chat(data)
    assert refused.value.code == "invalid_request"
    assert says in refused.value.message


def test_pages_and_gets_are_checked_and_read_back() -> None:
    got = parse_get(orjson.dumps({"conversation_id": "c", "cursor": "12", "limit": 5}))
    assert read_checked(encode_body(got), GetRequest).page == Page("12", 5)
    assert parse_list(b"") == Page(None, 100)
    for data, says in (
        (orjson.dumps({"conversation_id": "c", "cursor": "\u00b2"}), "next_cursor"),
        (orjson.dumps({"cursor": "c"}), "'conversation_id' is required"),
    ):
        with pytest.raises(ApiError, match=says):
            parse_get(data)
    for data in (orjson.dumps({"cursor": "zz"}), orjson.dumps({"limit": 1001})):
        with pytest.raises(ApiError):
            parse_list(data)


def test_a_grammar_that_cannot_compile_is_refused_naming_its_field_in_the_error_body() -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(ApiError) as refused:
        parse_chat(orjson.dumps({"message": "hi", "response_format": bad}))
    assert refused.value.param == "response_format.json_schema.schema"
    error = orjson.loads(refused.value.body())["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "param" not in orjson.loads(ApiError("not_found", "no such").body())["error"]


def test_a_turn_keeps_what_its_request_asked_the_reply_to_be() -> None:
    fmt = {"type": "regex", "regex": "[a-z]+"}
    asked = parse_chat(orjson.dumps({"message": "hi", "response_format": fmt}))
    assert asked.structure == {"response_format": fmt}
    assert asked.grammar is not None and asked.grammar.source == "[a-z]+"
    called = parse_chat(orjson.dumps({"message": "hi", "tools": TOOLS, "tool_choice": WEATHER}))
    assert called.structure == {"tools": tuple(TOOLS), "tool_choice": WEATHER}
    assert parse_chat(orjson.dumps({"message": "hi"})).structure == {}
