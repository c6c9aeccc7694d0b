"""The parsing of the client API's requests (`pensieve.v1.*`, their types in `schemas.py`).

A request body is parsed once, by the ingress (`parse_chat`, `parse_get`, ...): its types and
ranges are checked while it is decoded, then the rules that span fields. Bad input raises
`ApiError` with one of the contract's codes and a message that says what is wrong. The ingress
hands the checked request on as `encode_body` writes it, and the scheduler reads it back with
`read_checked`, checking nothing again.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from msgspec import UnsetType

from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.schemas import (
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS,
    MAX_PAGE,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TIMEOUT_S,
    MAX_TOKENS_LIMIT,
    ROLES,
    ApiError,
    ChatBody,
    ChatRequest,
    ChatTurn,
    ConversationRef,
    CreateBody,
    GetRequest,
    NamedToolChoice,
    Page,
    StatsRequest,
)
from pensieve.actors.wire.structured import GrammarError, grammar_of
from pensieve.store import validate_conversation_id

_S = TypeVar("_S", bound=msgspec.Struct)
_ENCODER = msgspec.json.Encoder()


# what a field must be, said in a refusal of a value the decoder did not take
_RULES = {
    "conversation_id": "'conversation_id' must be a string",
    "message": "'message' must be a non-empty string",
    "messages": "'messages' must be a non-empty array",
    "max_tokens": f"'max_tokens' must be an integer in [1, {MAX_TOKENS_LIMIT}]",
    "temperature": "'temperature' must be a number >= 0",
    "top_p": "'top_p' must be a number in (0, 1]",
    "top_k": "'top_k' must be null or an integer >= 1",
    "min_p": "'min_p' must be a number in [0, 1)",
    "min_tokens": f"'min_tokens' must be an integer in [0, {MAX_TOKENS_LIMIT}]",
    "presence_penalty": "'presence_penalty' must be a number in [-2, 2]",
    "frequency_penalty": "'frequency_penalty' must be a number in [-2, 2]",
    "logit_bias": f"'logit_bias' must be null or an object of up to {MAX_LOGIT_BIAS} token ids "
    "(strings of digits) to numbers in [-100, 100]",
    "seed": f"'seed' must be null or an integer in [0, {MAX_SEED}]",
    "stop": f"'stop' must be up to {MAX_STOP_STRINGS} non-empty strings",
    "ignore_eos": "'ignore_eos' must be true or false",
    "stream": "'stream' must be true or false",
    "final": "'final' must be true or false",
    "timeout_s": f"'timeout_s' must be null or a number in (0, {MAX_TIMEOUT_S:.0f}]",
    "prompt": "'prompt' must be a non-empty string or a non-empty array of token ids",
    "cache_salt": f"'cache_salt' must be null or a string of 1 to {MAX_CACHE_SALT} characters",
    "tools": "'tools' must be an array of {'type': 'function', 'function': {'name', "
    "'description', 'parameters'}} (a name of 1 to 64 letters, digits, '_', '.', '-')",
    "tool_choice": "'tool_choice' must be 'auto', 'none', 'required' or "
    "{'type': 'function', 'function': {'name'}}",
    "tool_results": "'tool_results' must be a non-empty array of {'tool_call_id', 'content'}",
    "response_format": "'response_format' must be {'type': 'text' | 'json_object' | "
    "'json_schema' | 'regex' | 'grammar'}, with 'json_schema': {'name', 'schema', 'strict'}, "
    "'regex' or 'grammar' (Lark) for the last three",
    "cursor": "'cursor' must be a 'next_cursor' from a reply",
    "limit": f"'limit' must be an integer in [1, {MAX_PAGE}]",
    "turn": "'turn' must be null or an integer >= 0",
}
_AT = re.compile(r" - at `\$\.(\w+)(?:\[(\d+)\](?:\.(\w+))?)?")
_FIELD = re.compile(r"(unknown|missing required) field `([^`]*)`")
_KINDS = {"array": "an array", "str": "a string", "bool": "a boolean", "null": "null"}


def _decode(data: bytes, cls: type[_S]) -> _S:
    """The request body as `cls` (an empty body is an empty object)."""
    try:
        return msgspec.json.decode(data if data.strip() else b"{}", type=cls)
    except msgspec.ValidationError as error:
        raise ApiError("invalid_request", _explain(str(error))) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ApiError("invalid_request", f"body is not valid JSON: {error}") from None


def _explain(problem: str) -> str:
    """A refusal in the API's words, from the decoder's."""
    at = _AT.search(problem)
    if at is not None and at[2] is not None and at[1] == "messages":
        if at[3] == "role":
            return f"messages[{at[2]}].role must be one of {ROLES}"
        if at[3] == "content":
            return f"messages[{at[2]}].content must be a string"
        if at[3] in ("tool_calls", "tool_call_id"):
            return f"messages[{at[2]}].{at[3]} must be " + (
                "a string" if at[3] == "tool_call_id" else "an array of tool calls"
            )
        return f"messages[{at[2]}] must be {{'role', 'content'}}"
    if at is not None:
        return _RULES.get(at[1], f"'{at[1]}': {problem}")
    field = _FIELD.search(problem)
    if field is not None and field[1] == "unknown":
        return f"unknown field(s): {field[2]}"
    if field is not None:
        return f"'{field[2]}' is required"
    kind = re.search(r"Expected `object`, got `(\w+)`", problem)
    if kind is not None:
        return f"body must be a JSON object, not {_KINDS.get(kind[1], 'a number')}"
    return problem


def parse_chat(data: bytes) -> ChatRequest:
    body = _decode(data, ChatBody)
    conv_id = None if body.conversation_id is None else _conversation_id(body.conversation_id)
    message = None if isinstance(body.message, UnsetType) else body.message
    messages = None if isinstance(body.messages, UnsetType) else body.messages
    prompt = None if isinstance(body.prompt, UnsetType) else body.prompt
    results = None if isinstance(body.tool_results, UnsetType) else body.tool_results
    stateful = message is not None or results is not None
    if sum((stateful, messages is not None, prompt is not None)) != 1:
        raise ApiError(
            "invalid_request",
            "give exactly one of 'message' (and/or 'tool_results'), 'messages' or 'prompt'",
        )
    if results is not None and conv_id is None:
        raise ApiError(
            "invalid_request", "'tool_results' answer a conversation's reply: give its id"
        )
    if message == "":
        raise ApiError("invalid_request", _RULES["message"])
    if prompt is not None and not prompt:
        raise ApiError("invalid_request", _RULES["prompt"])
    if body.turn and conv_id is None:
        raise ApiError("invalid_request", "a new conversation's first turn is turn 0", "turn")
    if prompt is not None and conv_id is not None:
        raise ApiError(
            "invalid_request", "a 'prompt' continues no conversation: leave out 'conversation_id'"
        )
    stop = (body.stop,) if isinstance(body.stop, str) else body.stop
    try:
        grammar = grammar_of(body.response_format)
    except GrammarError as error:
        raise ApiError("invalid_request", str(error), error.field) from None
    _check_min_tokens(body, bool(stop), grammar is not None)
    return ChatRequest(
        conversation_id=conv_id,
        message=message,
        messages=None if messages is None else _messages(messages),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items())),
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        stream=body.stream,
        final=body.final or prompt is not None,  # a raw completion is one turn
        timeout_s=body.timeout_s,
        prompt=prompt,
        cache_salt=body.cache_salt,
        **_tool_use(body, prompt is not None),
        tool_results=tuple(
            {"role": "tool", "content": r.content, "tool_call_id": r.tool_call_id}
            for r in results or ()
        ),
        response_format=body.response_format,
        turn=body.turn,
    )


def _check_min_tokens(body: ChatBody, stops: bool, constrained: bool) -> None:
    if not body.min_tokens:
        return
    if body.min_tokens > body.max_tokens:
        raise ApiError("invalid_request", "'min_tokens' must be at most 'max_tokens'", "min_tokens")
    named = isinstance(body.tool_choice, NamedToolChoice)
    if stops or constrained or body.tool_choice == "required" or named:
        raise ApiError(
            "invalid_request",
            "'min_tokens' goes with neither stop strings nor a constrained reply "
            "('response_format', a required or named tool choice)",
            "min_tokens",
        )


def _tool_use(body: ChatBody, raw: bool) -> dict[str, Any]:
    """The request's tools and what it asks of them (`ChatRequest.tools` and on)."""
    tools = tuple(msgspec.to_builtins(tool) for tool in body.tools)
    if tools and raw:
        raise ApiError("invalid_request", "a 'prompt' has no chat template to show 'tools' in")
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice == "required" and not tools:
        raise ApiError("invalid_request", "tool_choice 'required' needs 'tools'")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            "invalid_request",
            "a reply cannot be both a forced tool call and a 'response_format': give one",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {tool.function.name for tool in body.tools}:
            raise ApiError(
                "invalid_request", f"tool_choice names {name!r}, which is none of 'tools'"
            )
    elif choice == "auto" and not tools:
        raise ApiError("invalid_request", "tool_choice 'auto' needs 'tools'")
    return {"tools": tools, "tool_choice": choice}


def _messages(turns: tuple[ChatTurn, ...]) -> tuple[ChatMessage, ...]:
    if not turns:
        raise ApiError("invalid_request", _RULES["messages"])
    if turns[-1].role not in ("user", "tool"):
        raise ApiError("invalid_request", "the last of 'messages' must be the user's or a tool's")
    return tuple(_message(i, turn) for i, turn in enumerate(turns))


def _message(i: int, turn: ChatTurn) -> ChatMessage:
    if turn.content is None and not turn.tool_calls:
        raise ApiError("invalid_request", f"messages[{i}].content must be a string")
    if turn.tool_calls and turn.role != "assistant":
        raise ApiError("invalid_request", f"messages[{i}]: only an assistant's has 'tool_calls'")
    if (turn.role == "tool") != (turn.tool_call_id is not None):
        raise ApiError(
            "invalid_request", f"messages[{i}]: a tool's message, and only one, has 'tool_call_id'"
        )
    message: ChatMessage = {"role": turn.role, "content": turn.content or ""}
    if turn.tool_calls:
        message["tool_calls"] = [msgspec.to_builtins(call) for call in turn.tool_calls]
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    return message


def parse_conversation(data: bytes) -> ConversationRef:
    """`conversations.delete` and `chat.cancel`: a conversation id alone."""
    ref = _decode(data, ConversationRef)
    _conversation_id(ref.conversation_id)
    return ref


def parse_list(data: bytes) -> Page:
    """`conversations.list`: `{"cursor": <next_cursor of the page before>, "limit": N}`."""
    page = _decode(data, Page)
    if page.cursor is not None and not _is_hex(page.cursor):
        raise ApiError("invalid_request", "'cursor' must be a 'next_cursor' from a list reply")
    return page


def parse_get(data: bytes) -> GetRequest:
    """`conversations.get`: `{"conversation_id", "cursor": <next_cursor>, "limit": N}`; the
    cursor is the number of the first turn to answer."""
    request = _decode(data, GetRequest)
    _conversation_id(request.conversation_id)
    if request.cursor is not None and not _is_turn_number(request.cursor):
        raise ApiError("invalid_request", "'cursor' must be a 'next_cursor' from a get reply")
    return request


def parse_create(data: bytes) -> CreateBody:
    """`conversations.create`: `{"messages": [...]}`, the chat its first turn continues."""
    return _decode(data, CreateBody)


def parse_stats(data: bytes) -> StatsRequest:
    return _decode(data, StatsRequest)


def encode_body(body: msgspec.Struct) -> bytes:
    """A body of the client API as JSON: a checked request as the ingress hands it to the
    scheduler, or a reply."""
    return _ENCODER.encode(body)


def read_checked(data: bytes, cls: type[_S]) -> _S:
    """A request the ingress checked and encoded (`encode_body`): decoded, not checked again."""
    try:
        return msgspec.json.decode(data, type=cls)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ApiError("invalid_request", f"not a request the ingress checked: {error}") from None


def _conversation_id(value: str) -> str:
    try:
        return validate_conversation_id(value)
    except ValueError as exc:
        raise ApiError("invalid_request", str(exc)) from None


def _is_turn_number(text: str) -> bool:
    # ASCII only: str.isdigit also takes '²', which int() refuses; 20 digits stay far below
    # int()'s limit on the digits it reads (4300) and above any turn count
    return text.isascii() and text.isdigit() and len(text) <= 20


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return bool(text)
