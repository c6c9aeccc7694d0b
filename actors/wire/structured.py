"""Structured output: what a reply must match, from the client API's `response_format` to the
grammar the executor's sampler enforces (no I/O).

A request's `response_format` (OpenAI's shape, and two of Pensieve's own: a regular expression
and a Lark grammar) becomes a `Grammar`: plain data that travels with the turn's sampling
parameters to the executor, which compiles it for llguidance and masks every sampled token with
it (`actors/executor/grammar.py`). The ingress checks it here once, with the same library, so a
grammar that cannot compile is refused before the turn starts, naming the field at fault.

A JSON grammar here writes compact JSON (", " and ": " between items, no other whitespace): a
small model given free whitespace may spend its whole reply on newlines.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

GrammarKind = Literal["json_schema", "regex", "lark"]
# llguidance's JSON options, unless the schema's own "x-guidance" says otherwise
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT = {"type": "object"}  # `json_object`: any JSON object


class Grammar(msgspec.Struct, frozen=True):
    """What a constrained reply must match: a JSON schema (as JSON text), a regular expression
    or a Lark grammar (llguidance's dialect, which takes `%json {schema}` rules)."""

    kind: GrammarKind
    source: str

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> Grammar:
        return Grammar("json_schema", json.dumps(schema))

    def compiled(self) -> str:
        """The grammar as llguidance takes it; raises ValueError if it is not one."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        schema = json.loads(self.source)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]

    def problem(self) -> str | None:
        """Why the grammar cannot be enforced (None: it can)."""
        from llguidance import LLMatcher

        try:
            compiled = self.compiled()
        except ValueError as error:
            return str(error)
        return LLMatcher.validate_grammar(compiled) or None


class JsonSchemaFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """OpenAI's `json_schema` response format: the reply is JSON that `schema` validates."""

    name: str = "response"
    schema: dict[str, Any] | None = None  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # enforced either way


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """`response_format`: "text" (free), "json_object" (any JSON object), "json_schema" (JSON
    that `json_schema.schema` validates), "regex" (text that `regex` matches in full) or
    "grammar" (text of the Lark grammar `grammar`)."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None


class GrammarError(ValueError):
    """A response format that cannot be enforced; `field` names the part at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def grammar_of(
    fmt: ResponseFormat | None, field: str = "response_format", check: bool = True
) -> Grammar | None:
    """The grammar `fmt` asks for (None: free text); raises GrammarError naming the field of
    `fmt` (itself under `field`) at fault. `check` False: `fmt` was checked before, and is not
    compiled again."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        grammar = Grammar.json_schema(JSON_OBJECT)
        at = field
    elif fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise GrammarError(f"{field}.json_schema", "required for type 'json_schema'")
        schema = fmt.json_schema.schema
        grammar = Grammar.json_schema(JSON_OBJECT if schema is None else schema)
        at = f"{field}.json_schema.schema"
    else:
        key = "regex" if fmt.type == "regex" else "grammar"
        source = fmt.regex if fmt.type == "regex" else fmt.grammar
        if not source:
            raise GrammarError(f"{field}.{key}", f"required (a non-empty string) for type {key!r}")
        grammar = Grammar("regex" if key == "regex" else "lark", source)
        at = f"{field}.{key}"
    problem = grammar.problem() if check else None
    if problem is not None:
        raise GrammarError(at, f"not a grammar this server can enforce: {problem}")
    return grammar


def tool_call_grammar(
    tools: tuple[dict[str, Any], ...], names: tuple[str, ...], prefix: str, suffix: str, key: str
) -> Grammar:
    """A reply that is one call of one of the functions `names` of `tools`, written as a tool
    call parser reads it: `prefix`, then {"name": ..., key: arguments} with the arguments
    valid for the function's parameters, then `suffix`."""
    calls = [
        _call_schema(tool["function"], key) for tool in tools if tool["function"]["name"] in names
    ]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    parts = [json.dumps(prefix, ensure_ascii=False)] if prefix else []
    parts.append("call")
    if suffix:
        parts.append(json.dumps(suffix, ensure_ascii=False))
    return Grammar("lark", f"start: {' '.join(parts)}\ncall: %json {json.dumps(schema)}")


def _call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }
