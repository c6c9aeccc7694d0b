"""The client API's messages (`pensieve.v1.*`): parsing and validation of requests, reply bodies.

Every body is a JSON object encoded with orjson. Bad input raises `ApiError` with one of the
contract's codes and a message that says what is wrong; nothing here touches the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from pensieve.actors.tokenizer.chat_tokenizer import ChatMessage
from pensieve.store import validate_conversation_id

# every error code, with the HTTP-like status the NATS service error header carries for it
ERROR_STATUS = {
    "invalid_request": 400,
    "not_found": 404,
    "too_long": 413,
    "overloaded": 429,
    "cancelled": 499,
    "unavailable": 503,
    "internal": 500,
}
ERROR_CODES = tuple(ERROR_STATUS)
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 8
MAX_TOKENS_LIMIT = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class ApiError(Exception):
    """A request the service refuses; `code` is one of `ERROR_CODES`."""

    def __init__(self, code: str, message: str) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message

    def body(self) -> bytes:
        return orjson.dumps({"error": {"code": self.code, "message": self.message}})


@dataclass(frozen=True)
class ChatRequest:
    conversation_id: str | None  # None: a new conversation
    message: str | None  # the next user message (stateful client)
    messages: tuple[ChatMessage, ...] | None  # the whole chat (stateless client)
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    final: bool = False  # the conversation ends after this turn
    timeout_s: float | None = None  # cancelled if not done this long after it arrived
    # a raw completion instead of a chat: text the tokenizer encodes as it is (no chat template),
    # or the prompt's token ids; its conversation ends after the turn
    prompt: str | tuple[int, ...] | None = None


_CHAT_FIELDS = frozenset(
    {
        "conversation_id",
        "message",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "ignore_eos",
        "stream",
        "final",
        "timeout_s",
        "prompt",
    }
)
MAX_PROMPT_TOKEN = (1 << 31) - 1  # a token id past the model's vocabulary is refused later


def load_object(data: bytes) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is an empty object)."""
    if not data.strip():
        return {}
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ApiError("invalid_request", f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("invalid_request", f"body must be a JSON object, not {_kind(body)}")
    return body


def load_fields(data: bytes, fields: frozenset[str]) -> dict[str, Any]:
    """The request body as a JSON object with no field outside `fields`: a misspelt or
    unsupported field is refused, never ignored (a `delete` must not run on a request it
    misread)."""
    body = load_object(data)
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError("invalid_request", f"unknown field(s): {', '.join(unknown)}")
    return body


CONVERSATION_FIELDS = frozenset({"conversation_id"})  # conversations.delete
NO_FIELDS: frozenset[str] = frozenset()  # stats
MAX_PAGE = 1000  # items one `list` or `get` answer holds at most
PAGE_BYTES = 512 << 10  # text one `get` answer holds at most (NATS's default payload: 1 MiB)


@dataclass(frozen=True)
class Page:
    """Which part of a listing to answer: after `cursor`, at most `limit` items."""

    cursor: str | None
    limit: int


def parse_list(data: bytes) -> Page:
    """`conversations.list`: `{"cursor": <next_cursor of the page before>, "limit": N}`."""
    body = load_fields(data, frozenset({"cursor", "limit"}))
    cursor = body.get("cursor")
    if cursor is not None and not (isinstance(cursor, str) and _is_hex(cursor)):
        raise ApiError("invalid_request", "'cursor' must be a 'next_cursor' from a list reply")
    return Page(cursor, _int(body, "limit", 100, 1, MAX_PAGE))


def parse_get(data: bytes) -> tuple[str, Page]:
    """`conversations.get`: `{"conversation_id", "cursor": <next_cursor>, "limit": N}`; the
    cursor is the number of the first turn to answer."""
    body = load_fields(data, frozenset({"conversation_id", "cursor", "limit"}))
    cursor = body.get("cursor")
    if cursor is not None and not (isinstance(cursor, str) and _is_turn_number(cursor)):
        raise ApiError("invalid_request", "'cursor' must be a 'next_cursor' from a get reply")
    return conversation_id(body), Page(cursor, _int(body, "limit", 100, 1, MAX_PAGE))


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


def parse_chat(data: bytes) -> ChatRequest:
    body = load_fields(data, _CHAT_FIELDS)
    conv_id = body.get("conversation_id")
    if conv_id is not None:
        conv_id = conversation_id(body)
    given = [name for name in ("message", "messages", "prompt") if name in body]
    if len(given) != 1:
        raise ApiError("invalid_request", "give exactly one of 'message', 'messages' or 'prompt'")
    message = messages = prompt = None
    if given == ["message"]:
        message = body["message"]
        if not isinstance(message, str) or not message:
            raise ApiError("invalid_request", "'message' must be a non-empty string")
    elif given == ["messages"]:
        messages = _messages(body["messages"])
    else:
        prompt = _prompt(body["prompt"])
        if conv_id is not None:
            raise ApiError(
                "invalid_request",
                "a 'prompt' continues no conversation: leave out 'conversation_id'",
            )
    return ChatRequest(
        conversation_id=conv_id,
        message=message,
        messages=messages,
        max_tokens=_int(body, "max_tokens", 256, 1, MAX_TOKENS_LIMIT),
        temperature=_float(body, "temperature", 0.0, low=0.0),
        top_p=_float(body, "top_p", 1.0, low=0.0, high=1.0, open_low=True),
        seed=None if body.get("seed") is None else _int(body, "seed", 0, 0, (1 << 63) - 1),
        stop=_stop(body.get("stop", [])),
        ignore_eos=_bool(body, "ignore_eos"),
        stream=_bool(body, "stream"),
        final=_bool(body, "final") or prompt is not None,  # a raw completion is one turn
        timeout_s=None
        if body.get("timeout_s") is None
        else _float(body, "timeout_s", 0.0, low=0.0, high=MAX_TIMEOUT_S, open_low=True),
        prompt=prompt,
    )


def _prompt(value: object) -> str | tuple[int, ...]:
    """A raw completion's prompt: non-empty text, or a non-empty array of token ids."""
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and value
        and all(type(t) is int and 0 <= t <= MAX_PROMPT_TOKEN for t in value)
    ):
        return tuple(value)
    raise ApiError(
        "invalid_request", "'prompt' must be a non-empty string or a non-empty array of token ids"
    )


def conversation_id(body: dict[str, Any]) -> str:
    """The body's `conversation_id`, validated (required)."""
    if "conversation_id" not in body:
        raise ApiError("invalid_request", "'conversation_id' is required")
    try:
        return validate_conversation_id(body["conversation_id"])
    except ValueError as exc:
        raise ApiError("invalid_request", str(exc)) from None


def chat_reply(
    conv_id: str,
    turn: int,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    prompt_tokens: int,
    cached: dict[str, int],
    final: bool = False,
) -> dict[str, Any]:
    reply: dict[str, Any] = {
        "conversation_id": conv_id,
        "turn": turn,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(token_ids),
            "cached_tokens": dict(cached),
        },
    }
    if final:  # said only when true: other replies keep their shape
        reply["final"] = True
    return reply


def _kind(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise ApiError("invalid_request", "'messages' must be a non-empty array")
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"role", "content"}:
            raise ApiError("invalid_request", f"messages[{i}] must be {{'role', 'content'}}")
        role, content = item["role"], item["content"]
        if role not in ROLES:
            raise ApiError("invalid_request", f"messages[{i}].role must be one of {ROLES}")
        if not isinstance(content, str):
            raise ApiError("invalid_request", f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "user":
        raise ApiError("invalid_request", "the last of 'messages' must be the user's")
    return tuple(out)


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError("invalid_request", f"'{key}' must be an integer in [{low}, {high}]")
    return value


def _float(
    body: dict[str, Any],
    key: str,
    default: float,
    low: float,
    high: float = math.inf,
    open_low: bool = False,
) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError("invalid_request", f"'{key}' must be a number")
    value = float(value)
    if not (low < value if open_low else low <= value) or not value <= high:
        raise ApiError("invalid_request", f"'{key}' is out of range: {value}")
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ApiError("invalid_request", f"'{key}' must be true or false")
    return value


def _stop(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or len(value) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise ApiError(
            "invalid_request", f"'stop' must be up to {MAX_STOP_STRINGS} non-empty strings"
        )
    return tuple(value)
