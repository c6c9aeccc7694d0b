"""Structured output end to end, with the official `openai` client and with nats-py, against
`pensieve serve` running SmolLM2 on the CPU: replies under a JSON schema validate against it
(nested objects, enums, arrays), a `json_object` reply parses, an invalid schema is a 400 that
names the field, `tool_choice: "required"` writes a valid call, a regular expression is
enforced over NATS, and a constrained request leaves the greedy replies of unconstrained
requests beside it as they are alone."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import nats
import openai
import orjson
import pytest

from pensieve.actors.wire import subjects
from tests.ops.http_server import MODEL, Server, client, serving
from tests.ops.tool_calling import QUESTION, TOOLS, write_template

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 120}
NAME = {"type": "string", "maxLength": 24}
SCHEMAS: list[dict[str, Any]] = [
    {  # enums and a number
        "type": "object",
        "properties": {
            "city": NAME,
            "sky": {"enum": ["sunny", "cloudy", "rainy"]},
            "temperature_c": {"type": "integer"},
        },
        "required": ["city", "sky", "temperature_c"],
        "additionalProperties": False,
    },
    {  # a nested object
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {"street": NAME, "country": NAME},
                "required": ["street", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    {  # an array of strings
        "type": "object",
        "properties": {
            "title": NAME,
            "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        },
        "required": ["title", "tags"],
        "additionalProperties": False,
    },
    {  # an array of objects with enums in them
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "fruit": {"enum": ["apple", "pear"]},
                        "count": {"type": "integer"},
                    },
                    "required": ["fruit", "count"],
                    "additionalProperties": False,
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["items", "paid"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Describe the weather in Paris.",
    "Tell me about a friend of yours.",
    "Summarise a book you like.",
    "What did you buy at the market?",
    "Write about your holiday.",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    template = write_template(tmp_path_factory.mktemp("template"))
    with serving(
        tmp_path_factory.mktemp("data"),
        *("--chat-template", str(template)),
        *("--gpu-cache-tokens", "8192", "--cpu-cache-tokens", "0"),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return client(server, server.tenant("alice"))


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema, "strict": True},
    }


def _ask(api: openai.OpenAI, prompt: str, **asked: Any) -> Any:
    messages = [{"role": "user", "content": prompt}]
    return api.chat.completions.create(model=MODEL, messages=messages, **GREEDY, **asked).choices[0]


def test_replies_under_a_json_schema_validate_against_it(api) -> None:
    cases = [(prompt, schema) for schema in SCHEMAS for prompt in PROMPTS]  # 20
    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(
            pool.map(lambda case: _ask(api, case[0], response_format=_json_schema(case[1])), cases)
        )
    for (prompt, schema), choice in zip(cases, replies, strict=True):
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_json_object_reply_parses(api) -> None:
    choice = _ask(api, "Give me a recipe.", response_format={"type": "json_object"})
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_a_responses_text_format_is_enforced_and_kept(api) -> None:
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
    answer = api.responses.create(
        model=MODEL, input=PROMPTS[0], text={"format": fmt}, temperature=0, max_output_tokens=120
    )
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)
    stored = api.responses.retrieve(answer.id)
    assert stored.text is not None and stored.text.format is not None
    assert stored.text.format.model_dump(exclude_none=True, by_alias=True) == fmt


def test_an_invalid_schema_is_refused_naming_the_field(api) -> None:
    bad = _json_schema({"type": "objekt"})
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(api, "Hello", response_format=bad)
    assert refused.value.status_code == 400
    assert "response_format.json_schema.schema" in refused.value.message
    assert refused.value.param == "response_format.json_schema.schema"
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    fmt = {"type": "json_schema", "name": "bad", "schema": {"type": "objekt"}}
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(model=MODEL, input="Hello", text={"format": fmt})
    assert refused.value.param == "text.format.schema"
    assert refused.value.body["param"] == "text.format.schema"  # type: ignore[index]
    assert _ask(api, "Hello", max_completion_tokens=4).finish_reason == "length"  # still serving


def test_a_constrained_request_leaves_its_neighbours_greedy_tokens_unchanged(api) -> None:
    free = PROMPTS[:3]
    alone = [_ask(api, prompt, max_completion_tokens=24).message.content for prompt in free]
    constrained = [(p, _json_schema(SCHEMAS[i])) for i, p in enumerate(PROMPTS[3:])]

    def run(case: tuple[str, dict[str, Any] | None]) -> Any:
        prompt, fmt = case
        if fmt is None:
            return _ask(api, prompt, max_completion_tokens=24)
        return _ask(api, prompt, response_format=fmt)

    with ThreadPoolExecutor(5) as pool:
        together = list(pool.map(run, [*((p, None) for p in free), *constrained]))
    assert [choice.message.content for choice in together[:3]] == alone
    for choice, (_, fmt) in zip(together[3:], constrained, strict=True):
        jsonschema.validate(json.loads(choice.message.content), fmt["json_schema"]["schema"])


def test_tool_choice_required_writes_a_valid_call(api) -> None:
    choice = _ask(api, QUESTION, tools=TOOLS, tool_choice="required")
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_regular_expression_is_enforced_over_nats_and_kept_in_its_turn(server) -> None:
    pattern = r"(yes|no), because [a-z ]{1,40}\."
    credentials = server.tenant("bob")["nats"]

    async def ask() -> dict[str, Any]:
        nc = await nats.connect(**credentials)
        try:
            body = {
                "message": "Is the sky blue?",
                "max_tokens": 60,
                "response_format": {"type": "regex", "regex": pattern},
            }
            answer = orjson.loads(
                (await nc.request(subjects.CHAT, orjson.dumps(body), timeout=120)).data
            )
            get = {"conversation_id": answer["conversation_id"]}
            got = await nc.request(subjects.CONVERSATIONS_GET, orjson.dumps(get), timeout=60)
            bad = {"message": "hi", "response_format": {"type": "regex", "regex": "(a"}}
            refused = await nc.request(subjects.CHAT, orjson.dumps(bad), timeout=120)
            return {
                "reply": answer,
                "got": orjson.loads(got.data),
                "refused": orjson.loads(refused.data),
            }
        finally:
            await nc.close()

    got = asyncio.run(ask())
    reply = got["reply"]
    assert reply["finish_reason"] == "stop" and re.fullmatch(pattern, reply["text"]), reply
    (turn,) = got["got"]["turns"]  # the turn record keeps what it was asked
    assert turn["response_format"] == {"type": "regex", "regex": pattern}
    assert "tools" not in turn and "tool_choice" not in turn
    error = got["refused"]["error"]
    assert error["code"] == "invalid_request" and error["param"] == "response_format.regex"
