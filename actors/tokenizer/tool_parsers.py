"""Tool calls found in a reply's text, by a parser per model family (no I/O).

A model asked with `tools` writes its calls as text in its family's format; a parser turns the
whole reply into its content (the text before the first call) and its calls, or answers None:
no call, or one it cannot read, and the reply stays plain text (never an error). The formats:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
                 (Qwen 2.5/3, Hermes); SmolLM2 writes a JSON array of calls in one block
    llama3_json  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, several
                 separated by ";" (Llama 3.1+)

`tool_choice` "required" or naming a function is enforced by a grammar of a call in the
parser's format (`forced_prefix`, the call's JSON object, `closer`; `actors/wire/structured.py`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (as OpenAI answers it)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the reply's text before its first call
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolParser:
    """One family's format: where calls start (`markers`), how a forced call is written."""

    name: str
    markers: tuple[str, ...]  # a call begins at the first of these
    arguments_key: str  # the key of a call's arguments, in a forced call
    forced_prefix: str  # what comes before the call's JSON object
    whole_reply: bool = False  # calls only where the reply begins with them (no content)
    closer: str | None = None  # what ends a call: a forced call's reply stops there

    def start(self, text: str) -> int | None:
        """Where the first call begins in `text` (None: no marker in it)."""
        if self.whole_reply:
            return 0 if text.lstrip().startswith(self.markers) else None
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found, default=None)

    def held(self, text: str) -> int:
        """How many characters at the end of `text` may be the beginning of a marker (a
        streamed reply keeps them back until it knows)."""
        if self.whole_reply:
            opening = text.lstrip()
            return len(text) if any(m.startswith(opening) for m in self.markers) else 0
        longest = 0
        for marker in self.markers:
            for n in range(1, len(marker)):
                if text.endswith(marker[:n]):
                    longest = max(longest, n)
        return longest

    def parse(self, text: str) -> ParsedReply | None:
        """The reply's content and calls; None when it makes no call, or a malformed one."""
        begin = self.start(text)
        if begin is None:
            return None
        called = text[begin:]
        bodies = _llama_bodies(called) if self.whole_reply else _hermes_bodies(called)
        calls = None if bodies is None else _calls(bodies)
        return None if not calls else ParsedReply(text[:begin], calls)


HERMES = ToolParser("hermes", ("<tool_call>",), "arguments", "<tool_call>\n", closer="</tool_call>")
# a Llama 3 call is the whole reply: it starts the reply, after <|python_tag|> or not
LLAMA3_JSON = ToolParser("llama3_json", ("<|python_tag|>", "{"), "parameters", "", whole_reply=True)
PARSERS = {parser.name: parser for parser in (HERMES, LLAMA3_JSON)}


def parser_for(chat_template: str | None, name: str | None = None) -> ToolParser:
    """The parser `name` (`--tool-call-parser`); without one, the one the model's chat template
    asks for: Llama 3's JSON where it speaks of <|python_tag|> or a call's "parameters",
    else Hermes-style blocks (Qwen's, Hermes', and what SmolLM2 was trained to write)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"no tool-call parser {name!r}; there are {', '.join(PARSERS)}")
        return PARSERS[name]
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3_JSON
    return HERMES


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes_bodies(text: str) -> list[Any] | None:
    """The JSON of each `<tool_call>` block (an array in a block is several calls); None if
    a block is no JSON, or text other than blank lies between blocks."""
    bodies: list[Any] = []
    end = 0
    for block in _BLOCK.finditer(text):
        if text[end : block.start()].strip():
            return None
        end = block.end()
        try:
            body = json.loads(block[1])
        except ValueError:
            return None
        bodies.extend(body if isinstance(body, list) else [body])
    return bodies if not text[end:].strip() else None


def _llama_bodies(text: str) -> list[Any] | None:
    """The JSON objects of a Llama 3 reply, separated by ";" (None: anything else in it)."""
    rest = text.removeprefix("<|python_tag|>").strip()
    bodies: list[Any] = []
    while rest:
        try:
            body, end = _JSON.raw_decode(rest)
        except ValueError:
            return None
        bodies.append(body)
        rest = rest[end:].strip().removeprefix(";").strip()
    return bodies


def _calls(bodies: list[Any]) -> tuple[ToolCall, ...] | None:
    calls = []
    for body in bodies:
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        arguments = body.get("arguments", body.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(_call(body["name"], arguments))
    return tuple(calls)


def _call(name: str, arguments: dict[str, Any]) -> ToolCall:
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments_text)
