"""Tool calls read from replies, on recorded outputs of each family: Hermes-style blocks (Qwen,
and SmolLM2's array of calls in one block), Llama 3's JSON; several calls; the text before them;
a malformed call is plain text; a streamed reply keeps back only what may begin a call."""

from __future__ import annotations

import json

import pytest

from pensieve.actors.tokenizer.tool_parsers import HERMES, LLAMA3_JSON, parser_for

QWEN_TWO_CALLS = (
    "Let me look both up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris", "utc": false}}\n</tool_call>'
)
SMOLLM2_ARRAY = (
    '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Rome"}},\n'
    '{"name": "get_time", "arguments": {"city": "Oslo"}}\n]</tool_call>'
)
LLAMA_TWO_CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
    '{"name": "get_time", "parameters": {}}'
)


def calls(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def test_hermes_blocks_are_calls_and_the_text_before_them_the_content() -> None:
    parsed = HERMES.parse(QWEN_TWO_CALLS)
    assert parsed is not None and parsed.content == "Let me look both up.\n"
    assert calls(parsed) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Paris", "utc": False}),
    ]
    assert len({call.id for call in parsed.calls}) == 2 and parsed.calls[0].id.startswith("call_")
    # SmolLM2's format: an array of calls in one block
    assert calls(HERMES.parse(SMOLLM2_ARRAY)) == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {"city": "Oslo"}),
    ]
    # a last block cut short of its closing tag, and arguments written as JSON text
    unclosed = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n'
    assert calls(HERMES.parse(unclosed)) == [("f", {"x": 1})]


def test_llama3_json_calls_are_the_whole_reply() -> None:
    parsed = LLAMA3_JSON.parse(LLAMA_TWO_CALLS)
    assert parsed is not None and parsed.content == ""
    assert calls(parsed) == [("get_weather", {"city": "Lima"}), ("get_time", {})]
    # <|python_tag|> is a special token, gone from the decoded text
    assert calls(LLAMA3_JSON.parse(' {"name": "f", "parameters": {"a": [1]}}')) == [
        ("f", {"a": [1]})
    ]
    # JSON in the middle of a reply is no call
    assert LLAMA3_JSON.parse('Here is JSON: {"name": "f", "parameters": {}}') is None


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HERMES, "The weather in Paris is sunny."),  # no call
        (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1</tool_call>'),  # bad JSON
        (HERMES, '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
        (HERMES, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # no object
        (HERMES, '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then text'),
        (LLAMA3_JSON, '{"name": "f", "parameters": {}} and then text'),
        (LLAMA3_JSON, '{"name": "f", "parameters": {"x": '),  # cut short
        (LLAMA3_JSON, "[1, 2]"),
    ],
)
def test_a_reply_with_no_call_or_a_malformed_one_is_plain_text(parser, text) -> None:
    assert parser.parse(text) is None


def test_a_streamed_reply_keeps_back_only_what_may_begin_a_call() -> None:
    assert HERMES.start("Sure. <tool_call>{") == 6
    assert HERMES.held("Sure. <tool") == len("<tool") and HERMES.held("Sure.") == 0
    assert LLAMA3_JSON.start('  {"name"') == 0 and LLAMA3_JSON.start("Hi {") is None
    assert LLAMA3_JSON.held("  ") == 2 and LLAMA3_JSON.held("Hi") == 0


def test_the_parser_is_the_one_named_or_the_one_the_template_speaks_of() -> None:
    assert parser_for("... <tool_call> ...") is HERMES
    assert parser_for("{{- '<|python_tag|>' }}") is LLAMA3_JSON
    assert parser_for(None) is HERMES and parser_for(None, "llama3_json") is LLAMA3_JSON
    with pytest.raises(ValueError, match="no tool-call parser"):
        parser_for(None, "mistral")
