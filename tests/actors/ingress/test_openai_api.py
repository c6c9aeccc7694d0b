"""The OpenAI API's translation core: requests into client API chat requests, replies into
OpenAI's bodies, errors into OpenAI's shape with their status codes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pensieve.actors.ingress.openai_api import (
    MAX_CHOICES,
    OpenAIError,
    bearer_token,
    choice_chats,
    from_reply_error,
    to_chat,
    to_text_completion,
)
from pensieve.actors.ingress.openai_replies import (
    completion,
    first_chunks,
    last_chunks,
    usage,
    usage_chunk,
)
from pensieve.actors.wire.request_parsing import parse_chat
from pensieve.actors.wire.schemas import MAX_SEED, MAX_TOKENS_LIMIT, ApiError

USER = {"role": "user", "content": "Hi"}
SOURCES = {"gpu": 60, "cpu": 20, "disk": 5, "recomputed": 12, "new": 3, "shared": 10}
REPLY = {
    "conversation_id": "c-1",
    "turn": 1,
    "text": "Hello",
    "token_ids": [5, 6],
    "finish_reason": "stop",
    "usage": {
        "prompt_tokens": 100,
        "completion_tokens": 2,
        "cached_tokens": 85,
        "prompt_sources": SOURCES,
    },
}


def chat(body: dict[str, Any], header: str | None = None) -> dict[str, Any]:
    return to_chat(orjson.dumps(body), "m", header).chat


def test_a_stateless_request_is_the_whole_chat_with_openai_defaults() -> None:
    asked = to_chat(orjson.dumps({"model": "m", "messages": [USER]}), "m", None)
    assert asked.chat == {
        "stream": False,
        "messages": [USER],
        "max_tokens": MAX_TOKENS_LIMIT,
        "temperature": 1.0,
    }
    assert not asked.stream and asked.id.startswith("chatcmpl-")
    parse_chat(orjson.dumps(asked.chat))  # a valid chat request of the client API


def test_a_named_conversation_takes_one_new_message_or_a_whole_chat() -> None:
    assert chat({"messages": [USER], "conversation_id": "c-1"}) == {
        "stream": False,
        "conversation_id": "c-1",
        "message": "Hi",
        "max_tokens": MAX_TOKENS_LIMIT,
        "temperature": 1.0,
    }
    history = [USER, {"role": "assistant", "content": "Hello"}, USER]
    whole = chat({"messages": history}, header="c-1")
    assert whole["conversation_id"] == "c-1" and whole["messages"] == history
    with pytest.raises(OpenAIError) as clash:
        chat({"messages": [USER], "conversation_id": "c-1"}, header="c-2")
    assert clash.value.status == 400


def test_sampling_fields_carry_over_and_text_parts_join() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        "max_completion_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 3,
        "stop": ["x"],
        "ignore_eos": True,
        "stream": True,
        "user": "ignored",
    }
    got = chat(body)
    assert got["messages"] == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert {
        k: got[k]
        for k in ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "stream")
    } == {
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 3,
        "stop": ["x"],
        "ignore_eos": True,
        "stream": True,
    }


def test_a_response_format_goes_to_the_client_api_as_given() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    assert chat({"messages": [USER], "response_format": fmt})["response_format"] == fmt


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": [USER], "model": "other"}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
        ({"messages": [USER], "n": 0}, 400, "n"),
        ({"messages": [USER], "n": MAX_CHOICES + 1}, 400, "n"),
        ({"messages": [USER], "n": 2.5}, 400, "n"),
        ({"messages": [USER], "n": True}, 400, "n"),
        ({"messages": [USER], "n": 2, "conversation_id": "c-1"}, 400, "n"),
        ({"messages": [USER], "logprobs": True}, 400, "logprobs"),
        ({"messages": [USER], "functions": [{"name": "f"}]}, 400, "functions"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": 1}]}, 400, "messages"),
        ({"messages": [USER], "response_format": "json"}, 400, "response_format"),
        ({"messages": [USER], "stream": "yes"}, 400, "stream"),
        ({"messages": [USER], "conversation_id": 7}, 400, "conversation_id"),
    ],
)
def test_what_cannot_be_served_is_refused_in_openai_shape(body, status, param) -> None:
    with pytest.raises(OpenAIError) as refused:
        chat(body)
    error = refused.value.body()["error"]
    assert refused.value.status == status and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_a_body_that_is_not_an_object_is_refused() -> None:
    for data in (b"{", b"[]"):
        with pytest.raises(OpenAIError) as refused:
            to_chat(data, "m", None)
        assert refused.value.status == 400


@pytest.mark.parametrize(
    ("code", "status", "openai_code"),
    [
        ("invalid_request", 400, "invalid_request"),
        ("not_found", 404, "not_found"),
        ("too_long", 400, "context_length_exceeded"),
        ("overloaded", 429, "overloaded"),
        ("unavailable", 503, "unavailable"),
        ("internal", 500, "internal"),
    ],
)
def test_client_api_errors_keep_their_meaning(code, status, openai_code) -> None:
    error = from_reply_error(orjson.loads(ApiError(code, "why").body()))
    assert (error.status, error.code, error.message) == (status, openai_code, "why")


def test_usage_says_where_the_prompt_came_from() -> None:
    assert usage(REPLY) == {
        "prompt_tokens": 100,
        "completion_tokens": 2,
        "total_tokens": 102,
        "prompt_tokens_details": {
            "cached_tokens": 85,
            "prompt_sources": SOURCES,
        },
    }


def test_replies_become_a_completion_or_the_last_chunks() -> None:
    body = {
        "messages": [USER],
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    asked = to_chat(orjson.dumps(body), "m", None)
    whole = completion(asked, [REPLY])
    assert whole["object"] == "chat.completion" and whole["model"] == "m"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert whole["choices"][0]["token_ids"] == [5, 6]
    (finish,) = last_chunks(asked, REPLY)
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["id"] == asked.id
    totals = usage_chunk(asked, [REPLY])
    assert totals["choices"] == [] and totals["usage"] == usage(REPLY)


def test_bearer_tokens() -> None:
    assert bearer_token(None) is None
    assert bearer_token("Bearer  pk-1 ") == "pk-1"
    for header in ("Basic abc", "Bearer", "pk-1"):
        with pytest.raises(OpenAIError) as refused:
            bearer_token(header)
        assert refused.value.status == 401


def test_a_completion_is_one_raw_prompt_with_openai_defaults() -> None:
    """`/v1/completions`: the prompt (text or ids, or a batch of one) as a client API `prompt`
    request, 16 tokens by default; vLLM's no-op sampling fields pass, a real ask is refused."""
    asked = to_text_completion(
        orjson.dumps({"model": "m", "prompt": "Once", "repetition_penalty": 1.0}), "m"
    )
    assert asked.text and asked.id.startswith("cmpl-")
    assert asked.chat == {"prompt": "Once", "stream": False, "max_tokens": 16, "temperature": 1.0}
    request = parse_chat(orjson.dumps(asked.chat))
    assert request.prompt == "Once" and request.final and request.conversation_id is None
    ids = to_text_completion(orjson.dumps({"prompt": [[1, 2, 3]], "max_tokens": 4}), "m")
    assert parse_chat(orjson.dumps(ids.chat)).prompt == (1, 2, 3)
    for body, param in (
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
    ):
        with pytest.raises(OpenAIError) as refused:
            to_text_completion(orjson.dumps(body), "m")
        assert refused.value.status == 400 and refused.value.param == param, body


def test_a_completions_chunks_and_reply_carry_text() -> None:
    body = {"prompt": "Once", "stream": True, "stream_options": {"include_usage": True}}
    asked = to_text_completion(orjson.dumps(body), "m")
    whole = completion(asked, [REPLY])
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "Hello"
    assert "conversation_id" not in whole  # a raw completion's conversation has ended
    (finish,) = last_chunks(asked, REPLY)
    totals = usage_chunk(asked, [REPLY])
    assert finish["object"] == totals["object"] == "text_completion"
    assert finish["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "finish_reason": "stop",
        "text": "",
    }
    assert totals["usage"]["prompt_tokens"] == 100 and totals["choices"] == []


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
CALLED = {**REPLY, "text": "", "finish_reason": "tool_calls", "tool_calls": [CALL]}


def test_tools_and_tool_messages_carry_over_and_results_continue_a_named_conversation() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    called = {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None}
    result = {"role": "tool", "content": "7", "tool_call_id": "call_1"}
    body = {"messages": [USER, called, result], "tools": tools, "tool_choice": "auto"}
    got = chat(body)
    assert got["tools"] == tools and got["tool_choice"] == "auto"
    assert got["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert got["messages"][2] == result
    parse_chat(orjson.dumps(got))  # a valid chat request of the client API
    # the results alone, the conversation named: its next turn, the stateful way
    named = chat({"messages": [result, USER], "tools": tools}, header="c-1")
    assert named["tool_results"] == [{"tool_call_id": "call_1", "content": "7"}]
    assert named["message"] == "Hi" and "messages" not in named
    parse_chat(orjson.dumps(named))


def test_a_reply_that_calls_tools_is_answered_as_openai_does_whole_and_streamed() -> None:
    asked = to_chat(orjson.dumps({"messages": [USER], "stream": True}), "m", None)
    message = completion(asked, [CALLED])["choices"][0]
    assert message["message"] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert message["finish_reason"] == "tool_calls"
    chunks = last_chunks(asked, CALLED)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[:2] == [
        {"tool_calls": [{"index": 0, **CALL, "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_docs_say_how_the_http_and_nats_sampling_defaults_differ() -> None:
    """Without `temperature`, HTTP samples at OpenAI's 1.0 and NATS greedily: docs/http.md says
    both, with the figures the code uses."""
    import re
    from pathlib import Path

    from pensieve.actors.ingress.openai_api import to_chat

    user = {"role": "user", "content": "Hi"}
    http = to_chat(orjson.dumps({"messages": [user]}), "m", None).chat["temperature"]
    nats = parse_chat(orjson.dumps({"message": "Hi"})).temperature
    docs = Path(__file__).resolve().parents[3] / "docs/http.md"
    said = " ".join(docs.read_text().split())
    found = re.search(r"\*\*Sampling defaults[^*]*\*\*(.*?)(?:\n\n|$)", said)
    assert found is not None, "docs/http.md says nothing of the sampling defaults"
    assert f"default of {http}" in found[1] and f"greedily ({nats})" in found[1]
    assert '"temperature": 0' in found[1]


def test_n_choices_are_one_chat_request_each_with_the_seed_counted_up() -> None:
    asked = to_chat(orjson.dumps({"messages": [USER], "n": 3, "seed": 7}), "m", None)
    assert [c["seed"] for c in choice_chats(asked)] == [7, 8, 9]
    assert all(c["messages"] == [USER] for c in choice_chats(asked))
    wrapped = to_text_completion(orjson.dumps({"prompt": "a", "n": 2, "seed": MAX_SEED}), "m")
    assert [c["seed"] for c in choice_chats(wrapped)] == [MAX_SEED, 0]
    unseeded = to_chat(orjson.dumps({"messages": [USER], "n": 2}), "m", None)
    assert choice_chats(unseeded) == [unseeded.chat] * 2 and "seed" not in unseeded.chat
    one = to_chat(orjson.dumps({"messages": [USER], "n": None, "seed": 7}), "m", None)
    assert one.n == 1 and choice_chats(one) == [one.chat]
    with pytest.raises(OpenAIError) as refused:  # the header names a conversation too
        to_chat(orjson.dumps({"messages": [USER], "n": 2}), "m", "c-1")
    assert refused.value.param == "n" and "fork" in refused.value.message


def test_n_replies_become_n_choices_with_the_prompt_counted_once() -> None:
    body = {"messages": [USER], "n": 2, "stream": True, "return_token_ids": True}
    asked = to_chat(orjson.dumps(body), "m", None)
    other = {
        **REPLY,
        "conversation_id": "c-2",
        "text": "Hey",
        "token_ids": [7],
        "usage": {**REPLY["usage"], "completion_tokens": 1, "cached_tokens": 0},
    }
    whole = completion(asked, [REPLY, other])
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in whole["choices"]] == ["Hello", "Hey"]
    assert [c["token_ids"] for c in whole["choices"]] == [[5, 6], [7]]
    assert [c["conversation_id"] for c in whole["choices"]] == ["c-1", "c-2"]
    assert whole["conversation_id"] == "c-1"
    assert whole["usage"] == {**usage(REPLY), "completion_tokens": 3, "total_tokens": 103}
    assert [c["choices"][0]["index"] for c in first_chunks(asked)] == [0, 1]
    (finish,) = last_chunks(asked, other, 1)
    assert finish["choices"][0]["index"] == 1 and finish["choices"][0]["token_ids"] == [7]
    assert finish["choices"][0]["conversation_id"] == "c-2"
    assert usage_chunk(asked, [REPLY, other])["usage"] == whole["usage"]
