"""OpenAI's Responses API in terms of Pensieve's conversations (no I/O).

A response is a turn: its id names the conversation and the turn's number (`ResponseRef`), so
it lasts as long as the conversation's record in the store, and reaches only what the asking
tenant's conversations reach. A `POST /v1/responses` (`to_request`) becomes one chat turn
(`plan`):

- `previous_response_id` of the conversation's latest turn, or `conversation`: the next turn
  of that conversation, the new input alone sent as its next `message` when that is all that is
  new, else the whole chat (its KV reused up to the first token that differs);
- `previous_response_id` of an earlier turn: a new conversation, made with that turn's chat
  (`pensieve.v1.conversations.create`) and continued by the new input, so the prefix it shares
  with the first is served from the content-addressed cache;
- `store: false`: a conversation of its own (the whole chat sent, no stored one touched),
  deleted once the reply is out;
- `instructions`: the system message at the head of the chat, replacing the one there; a
  request without them keeps the chat's (OpenAI drops them, which would recompute the chat).

The streamed events are in `actors/ingress/response_events.py`; the HTTP handlers in
`actors/ingress/stateful_http.py`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from pensieve.actors.ingress import response_tools
from pensieve.actors.ingress.openai_api import ROLES, checked_body, flag
from pensieve.actors.ingress.openai_errors import OpenAIError, invalid
from pensieve.actors.wire.schemas import MAX_TOKENS_LIMIT

Message = dict[str, Any]
_RESPONSE_ID = re.compile(r"resp_(\d{1,10})_(.+)", re.DOTALL)
# options of the Responses API the engine cannot honour, and the values that ask for nothing
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "reasoning": (None, {}),
    "include": (None, []),
    "background": (None, False),
    "prompt": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "metadata": (None, {}),  # nowhere to keep it
    "max_tool_calls": (None,),
}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ResponseRef:
    """A response: turn `turn` of conversation `conv_id`."""

    conv_id: str
    turn: int

    @property
    def id(self) -> str:
        return f"resp_{self.turn}_{self.conv_id}"


def parse_response_id(text: str) -> ResponseRef:
    """The turn a response id names; 404 if it names none (as one that does not exist)."""
    match = _RESPONSE_ID.fullmatch(text)
    if match is None:
        raise not_found(text)
    return ResponseRef(match[2], int(match[1]))


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"No response found with id '{response_id}'.", "invalid_request_error", "not_found"
    )


@dataclass(frozen=True)
class ResponsesRequest:
    """A `POST /v1/responses` body, checked."""

    items: list[Message]  # the new input, as chat messages
    instructions: str | None
    previous: ResponseRef | None
    conversation: str | None
    store: bool
    stream: bool
    # of the `pensieve.v1.chat` request: max_tokens, temperature, top_p, response_format,
    # tools, tool_choice
    sampling: dict[str, Any]
    model: str
    created_at: int


def to_request(data: bytes, model: str) -> ResponsesRequest:
    """Parse a `POST /v1/responses` body for the model served as `model`."""
    body = checked_body(data, model, _UNSUPPORTED)
    response_format = _text_format(body.get("text"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("'previous_response_id' must be a string", "previous_response_id")
    conversation = _conversation(body.get("conversation"))
    if previous is not None and conversation is not None:
        raise invalid(
            "give 'previous_response_id' or 'conversation', not both", "previous_response_id"
        )
    store = body.get("store", True) is not False
    flag(body, "store")
    if not store and conversation is not None:
        raise invalid("a response in a conversation is stored: leave out 'store'", "store")
    max_tokens = body.get("max_output_tokens")
    sampling: dict[str, Any] = {
        "max_tokens": MAX_TOKENS_LIMIT if max_tokens is None else max_tokens,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
    }
    if body.get("top_p") is not None:
        sampling["top_p"] = body["top_p"]
    if response_format is not None:
        sampling["response_format"] = response_format
    sampling.update(response_tools.chat_tools(body))
    return ResponsesRequest(
        items=input_items(body.get("input"), "input"),
        instructions=instructions,
        previous=None if previous is None else parse_response_id(previous),
        conversation=conversation,
        store=store,
        stream=flag(body, "stream"),
        sampling=sampling,
        model=model,
        created_at=int(time.time()),
    )


def _text_format(text: object) -> dict[str, Any] | None:
    """`text.format` as the client API's `response_format` (None: free text). The Responses
    API gives a JSON schema's name, schema and strictness beside its type, not under
    `json_schema`; the client API checks the schema."""
    if text is None:
        return None
    if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
        raise invalid("'text' must be {'format': {'type': ...}}", "text")
    fmt = dict(text.get("format") or {"type": "text"})
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") != "json_schema":
        return fmt
    kind = fmt.pop("type")
    return {"type": kind, "json_schema": fmt}


def _conversation(value: object) -> str | None:
    """The `conversation` parameter: its id, or an object with it."""
    if isinstance(value, dict):
        value = value.get("id")
    if value is not None and not isinstance(value, str):
        raise invalid("'conversation' must be a conversation id", "conversation")
    return value


def input_items(value: object, param: str) -> list[Message]:
    """Input items (a string: one user message) as chat messages: messages of text, function
    calls and their outputs (`response_tools.input_item`)."""
    if value is None and param == "items":
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or (param == "input" and not value):
        raise invalid(f"'{param}' must be a string or an array of message items", param)
    messages: list[Message] = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and response_tools.input_item(item, f"{param}[{i}]", messages):
            continue
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise invalid(
                f"{param}[{i}] must be a message, function_call or function_call_output item",
                param,
            )
        role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise invalid(f"{param}[{i}].role must be one of {', '.join(ROLES)}", param)
        messages.append({"role": role, "content": _content(item.get("content"), f"{param}[{i}]")})
    return messages


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict)
        and part.get("type") in _TEXT_PARTS
        and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise invalid(
        f"{where}.content must be a string or an array of text parts", where.split("[")[0]
    )


def chat_until(opening: list[Message], turns: list[dict[str, Any]], upto: int) -> list[Message]:
    """A conversation's chat after turn `upto` (-1: before its first), from what
    `conversations.get` answers: the messages it was made with, and its turns in order."""
    chat = [_message(m) for m in opening]
    for turn in turns[: upto + 1]:
        if turn.get("history") is not None:
            chat = [_message(m) for m in turn["history"]]
        results = turn.get("tool_results", [])
        chat += [{"role": "tool", **result} for result in results]
        if turn["message"] or not results:
            chat.append({"role": "user", "content": turn["message"]})
        reply: Message = {"role": "assistant", "content": turn["text"]}
        if turn.get("tool_calls"):
            reply["tool_calls"] = turn["tool_calls"]
        chat.append(reply)
    return chat


def _message(message: dict[str, Any]) -> Message:
    """A chat message as `conversations.get` answers it (an assistant's that only calls
    tools has no content), as the turns' messages are written here."""
    return {**message, "content": message.get("content") or ""}


def with_input(context: list[Message], request: ResponsesRequest) -> list[Message]:
    """The whole chat of the turn: `context`, its head system message `instructions` where
    given, then the new input, which must end with the user's message or a tool's result."""
    chat = list(context)
    if request.instructions is not None:
        system = {"role": "system", "content": request.instructions}
        chat = [system, *chat[1:]] if chat and chat[0]["role"] == "system" else [system, *chat]
    chat += request.items
    if not chat or chat[-1]["role"] not in ("user", "tool"):
        raise invalid("the input must end with a user message or a function_call_output", "input")
    return chat


def last_sent(chat: list[Message]) -> int:
    """How many of the chat's last messages a turn sends after its conversation's last reply:
    the user's message, or the tool results that end it, with the tool results before the
    user's."""
    num = 1 if chat[-1]["role"] == "user" else 0
    while num < len(chat) and chat[-1 - num]["role"] == "tool":
        num += 1
    return num


def in_request_terms(error: OpenAIError) -> OpenAIError:
    """A chat request's error as the Responses request's: its `response_format` is the
    request's `text.format`, whose JSON schema's fields are not under `json_schema`."""
    param = error.param or ""
    if not param.startswith("response_format"):
        return error
    param = param.replace("response_format", "text.format", 1).replace(".json_schema", "", 1)
    message = error.message.replace(error.param or "", param, 1)
    return OpenAIError(error.status, message, error.kind, error.code, param)


def next_turn(conv_id: str, context: list[Message], chat: list[Message]) -> dict[str, Any]:
    """The chat request for the next turn of `conv_id`, whose chat so far is `context`."""
    alone = response_tools.sent_alone(chat[len(context) :])
    if chat[: len(context)] == context and alone is not None:
        return {"conversation_id": conv_id, **alone}
    return {"conversation_id": conv_id, "messages": chat}


def usage(reply: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's usage of a chat reply."""
    used = reply["usage"]
    return token_usage(
        used["prompt_tokens"],
        used["completion_tokens"],
        used["cached_tokens"],
        used["prompt_sources"],
    )


def token_usage(
    prompt: int, completion: int, cached: int, sources: dict[str, int]
) -> dict[str, Any]:
    """`input_tokens_details.cached_tokens` with `prompt_sources` beside it, as the chat
    completions' `prompt_tokens_details` has them."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "prompt_sources": sources},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response(
    ref: ResponseRef,
    request: ResponsesRequest | None,
    model: str,
    finished: dict[str, Any] | None,
) -> dict[str, Any]:
    """A `response` object; `finished`: the reply (None: in progress), with `text`,
    `finish_reason`, `usage` (OpenAI's) and any `tool_calls`; `request` None: a stored turn's,
    whose `finished` also holds what it asked (`sampling`). Its `conversation` names the one
    that holds it."""
    status, incomplete = "in_progress", None
    output = []
    if finished is not None:
        status = {"length": "incomplete", "cancelled": "cancelled"}.get(
            finished["finish_reason"], "completed"
        )
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        output = output_items(ref, finished["text"], finished.get("tool_calls") or [])
    sampling = request.sampling if request is not None else (finished or {}).get("sampling", {})
    tools = sampling.get("tools", [])
    return {
        "id": ref.id,
        "object": "response",
        "created_at": request.created_at
        if request is not None
        else (finished or {}).get("created_at", 0),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions if request is not None else None,
        "max_output_tokens": sampling.get("max_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": None
        if request is None or request.previous is None
        else request.previous.id,
        "conversation": {"id": ref.conv_id},
        "store": request.store if request is not None else True,
        "temperature": sampling.get("temperature"),
        "top_p": sampling.get("top_p", 1.0 if request is not None else None),
        "text": {"format": _format_of(sampling.get("response_format"))},
        "tool_choice": response_tools.response_choice(sampling.get("tool_choice"), tools),
        "tools": response_tools.response_tools(tools),
        "truncation": "disabled",
        "usage": None if finished is None else finished["usage"],
        "metadata": {},
    }


def _format_of(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """The `text.format` a response shows for the client API's `response_format`."""
    if response_format is None:
        return {"type": "text"}
    if response_format.get("type") != "json_schema":
        return response_format
    return {"type": "json_schema", **response_format.get("json_schema", {})}


def stored_response(ref: ResponseRef, turn: dict[str, Any], model: str) -> dict[str, Any]:
    """`GET /v1/responses/{id}`: the response of a stored turn (a `conversations.get` turn)."""
    asked = {k: turn[k] for k in ("response_format", "tools", "tool_choice") if k in turn}
    finished = {
        "text": turn["text"],
        "finish_reason": turn["finish_reason"],
        "tool_calls": turn.get("tool_calls"),
        "sampling": asked,
        "usage": token_usage(
            # a summary leaves out what is at its default (0)
            turn["prompt_tokens"],
            turn["completion_tokens"],
            turn.get("cached_tokens", 0),
            turn["prompt_sources"],
        ),
        "created_at": int(turn.get("started_at", 0)),
    }
    return response(ref, None, model, finished)


def output_items(ref: ResponseRef, text: str, calls: list[dict[str, Any]]) -> list[Message]:
    """A finished reply's output: its message (left out when the reply is calls alone), then
    its function calls."""
    message = [message_item(ref, text, "completed")] if text or not calls else []
    return message + [
        response_tools.call_item(ref.turn, ref.conv_id, i, call, "completed")
        for i, call in enumerate(calls)
    ]


def message_item(ref: ResponseRef, text: str, status: str) -> dict[str, Any]:
    """The assistant's message of a response."""
    content = [] if status == "in_progress" else [output_text(text)]
    return {
        "type": "message",
        "id": f"msg_{ref.turn}_{ref.conv_id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
