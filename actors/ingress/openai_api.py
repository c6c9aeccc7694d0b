"""OpenAI's chat-completions and completions APIs in terms of Pensieve's client API (no I/O).

The HTTP ingress (`actors/ingress/http_actor.py`) turns each `POST /v1/chat/completions` into one
`pensieve.v1.chat` request (`to_chat`), each `POST /v1/completions` into one with a raw `prompt`
(`to_text_completion`: no chat template, one turn); the replies and streamed deltas that come
back become OpenAI's response and chunk bodies (`openai_replies.py`) and error bodies (see
`openai_errors.py`). Where OpenAI is silent this follows vLLM: `ignore_eos`, `return_token_ids`
and `cache_salt` (cached prefixes are shared only among requests of one tenant with one salt)
are accepted as extra fields (and Pensieve's `final`: the conversation ends after this turn),
and an unsupported sampling option is refused, never ignored.

`n` above 1 asks for several choices: the HTTP ingress sends one chat request per choice
(`choice_chats`), and their replies come back as one body (`completion`) or one stream whose
chunks name their choice's `index`.

Statefulness: a request that names its conversation (the field `conversation_id`, or the header
`X-Conversation-Id`) with one user message in `messages` appends that message to it; with more
messages, they are the whole chat, and the KV is reused up to the first token where it differs
from the conversation's (the NATS API's stateless path). Without a name, the HTTP ingress looks
for the conversation the chat continues (`actors/ingress/chat_index.py`). Each response names its
conversation in the `X-Conversation-Id` header.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from pensieve.actors.ingress.openai_errors import OpenAIError as OpenAIError
from pensieve.actors.ingress.openai_errors import bearer_token as bearer_token
from pensieve.actors.ingress.openai_errors import from_api_error as from_api_error
from pensieve.actors.ingress.openai_errors import from_reply_error as from_reply_error
from pensieve.actors.ingress.openai_errors import invalid
from pensieve.actors.ingress.openai_errors import unauthorized as unauthorized
from pensieve.actors.wire.schemas import MAX_SEED, MAX_TOKENS_LIMIT

CONVERSATION_HEADER = "X-Conversation-Id"
# `n` at most: each choice is a turn that holds a running slot and, until it ends, its own copy of
# the prompt's KV, so one request may take at most this many of a batch's slots
MAX_CHOICES = 16
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# vLLM's extra sampling fields that the engine has no way to honour, which clients of vLLM
# send (`vllm bench serve`: a repetition penalty of 1), and the value that asks for nothing
_VLLM_SAMPLING: dict[str, tuple[object, ...]] = {
    "repetition_penalty": (None, 1, 1.0),
}
_NO_TOP_K = (-1, 0)  # vLLM's top_k values for every token
# options of OpenAI's API the engine has no way to honour, and the value that asks for nothing
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
    **_VLLM_SAMPLING,
}


@dataclass(frozen=True)
class Completion:
    """A chat-completions request as the client API's chat request, and how to answer it."""

    chat: dict[str, Any]  # the body of a `pensieve.v1.chat` request
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool  # the reply's token ids in the choice (vLLM's extra field)
    id: str
    created: int
    text: bool = False  # a completion of a raw prompt (`/v1/completions`), not of a chat
    n: int = 1  # the choices asked for: one chat request each


def to_chat(data: bytes, model: str, conversation_header: str | None) -> Completion:
    """Parse a `POST /v1/chat/completions` body for the model served as `model`."""
    body = checked_body(data, model, _UNSUPPORTED, MAX_CHOICES)
    messages = _messages(body.get("messages"))
    stream = flag(body, "stream")
    chat: dict[str, Any] = {"stream": stream}
    conv_id = _conversation_id(body.get("conversation_id"), conversation_header)
    n = body.get("n") or 1
    if conv_id is not None and n > 1:
        raise invalid(
            f"n={n} would fork conversation {conv_id} into {n}: ask with n=1, or name no "
            "conversation (send the whole chat in 'messages') to get one conversation per choice",
            "n",
        )
    if conv_id is not None:
        chat["conversation_id"] = conv_id
    if conv_id is not None and _only_new(messages):  # the next messages of a conversation
        if messages[-1]["role"] == "user":
            chat["message"] = messages[-1]["content"]
        results = [_result(m) for m in messages if m["role"] == "tool"]
        if results:
            chat["tool_results"] = results
    else:
        chat["messages"] = messages
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    chat["max_tokens"] = MAX_TOKENS_LIMIT if max_tokens is None else max_tokens  # to the context
    chat["temperature"] = body.get("temperature", 1.0)  # OpenAI's default
    for name in ("top_p", "seed", "stop", "ignore_eos", "final", "cache_salt", "tool_choice"):
        if body.get(name) is not None:
            chat[name] = body[name]
    chat.update(_extra_sampling(body))
    if body.get("tools"):  # checked by the client API, as its own `tools`
        chat["tools"] = body["tools"]
    response_format = body.get("response_format")
    if response_format is not None:  # its grammar is checked by the client API too
        if not isinstance(response_format, dict):
            raise invalid("'response_format' must be an object", "response_format")
        chat["response_format"] = response_format
    return Completion(
        chat,
        model,
        stream,
        _include_usage(body),
        flag(body, "return_token_ids"),
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        n=n,
    )


def checked_body(
    data: bytes, model: str, unsupported: dict[str, tuple[object, ...]], max_choices: int = 1
) -> dict[str, Any]:
    """The body of a request for the model served as `model`, with none of the `unsupported`
    options asking for something, and `n` (null: 1) from 1 to `max_choices`."""
    body = _object(data)
    asked = body.get("model", model)
    if asked != model:
        raise OpenAIError(
            404,
            f"The model `{asked}` does not exist.",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    for name, harmless in unsupported.items():
        if name in body and body[name] not in harmless:
            raise invalid(f"'{name}' is not supported by this server", name)
    n = body.get("n")
    if n is not None and not (type(n) is int and 1 <= n <= max_choices):
        allowed = "only n=1 is" if max_choices == 1 else f"n from 1 to {max_choices} is"
        raise invalid(f"'n' is {n!r}; {allowed} supported", "n")
    return body


def choice_chats(request: Completion) -> list[dict[str, Any]]:
    """The chat request of each of the request's `n` choices: with a `seed`, choice i draws
    with `seed` + i (wrapped past the largest), so the choices differ yet are reproducible;
    without one, each turn draws its own."""
    seed = request.chat.get("seed")
    if type(seed) is not int or not 0 <= seed <= MAX_SEED:  # none, or refused by the client API
        return [request.chat] * request.n
    return [{**request.chat, "seed": (seed + i) % (MAX_SEED + 1)} for i in range(request.n)]


def _extra_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The penalties and logit bias, and vLLM's `top_k` and `min_p`, as the chat request
    takes them (checked there); the values that ask for nothing are left out."""
    extra = {
        name: body[name]
        for name in ("presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")
        if body.get(name) not in (None, 0, {})
    }
    top_k = body.get("top_k")
    if top_k is not None and not (type(top_k) is int and top_k in _NO_TOP_K):
        extra["top_k"] = top_k
    min_p = body.get("min_p")
    if min_p is not None and min_p != 0:
        extra["min_p"] = min_p
    return extra


def _include_usage(body: dict[str, Any]) -> bool:
    """stream_options.include_usage: a last chunk with the usage."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    return bool(options.get("include_usage"))


# `/v1/completions` options with no engine behind them, and the value that asks for nothing
_TEXT_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (None, False),
    "logprobs": (None, 0),
    "suffix": (None, ""),
    "best_of": (None, 1),
    **_VLLM_SAMPLING,
}
TEXT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for a completion


def to_text_completion(data: bytes, model: str) -> Completion:
    """Parse a `POST /v1/completions` body for the model served as `model`: one prompt (text,
    or token ids), completed as it is and forgotten after (its KV freed at once)."""
    body = checked_body(data, model, _TEXT_UNSUPPORTED, MAX_CHOICES)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if not (
        isinstance(prompt, str)
        or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt))
    ):
        raise invalid(
            "'prompt' must be a string or an array of token ids (one prompt; a batch "
            "of several is not supported)",
            "prompt",
        )
    stream = flag(body, "stream")
    max_tokens = body.get("max_tokens")
    chat: dict[str, Any] = {
        "prompt": prompt,
        "stream": stream,
        "max_tokens": TEXT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": body.get("temperature", 1.0),  # OpenAI's default
    }
    for name in ("top_p", "seed", "stop", "ignore_eos", "cache_salt"):
        if body.get(name) is not None:
            chat[name] = body[name]
    chat.update(_extra_sampling(body))
    return Completion(
        chat,
        model,
        stream,
        _include_usage(body),
        flag(body, "return_token_ids"),
        f"cmpl-{uuid.uuid4().hex}",
        int(time.time()),
        text=True,
        n=body.get("n") or 1,
    )


def reply_message(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply as the assistant's message of the chat a client sends next (`_messages`'s
    shape)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply["text"]}
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    return message


def models(model: str, created: int, max_model_len: int | None = None) -> dict[str, Any]:
    """`GET /v1/models`: the one model served (with its context, as vLLM's, where known)."""
    card: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "pensieve",
        "root": model,
    }
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


def _object(data: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise invalid(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value not in (None, True, False):
        raise invalid(f"'{name}' must be true or false", name)
    return bool(value)


def _conversation_id(field: object, header: str | None) -> str | None:
    if field is not None and header is not None and field != header:
        raise invalid(
            f"the field 'conversation_id' and the header {CONVERSATION_HEADER} "
            "name different conversations",
            "conversation_id",
        )
    chosen = field if field is not None else header
    if chosen is not None and not isinstance(chosen, str):
        raise invalid("'conversation_id' must be a string", "conversation_id")
    return chosen


def _messages(value: object) -> list[dict[str, Any]]:
    """The chat as the client API takes it: each message's role and text content, an
    assistant's tool calls and a tool's `tool_call_id`."""
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        role = ROLES.get(message.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        calls = message.get("tool_calls") if role == "assistant" else None
        content = message.get("content")
        text = "" if calls and content is None else _text(content, i)  # a call has none
        given: dict[str, Any] = {"role": role, "content": text}
        if calls:
            given["tool_calls"] = _tool_calls(calls, i)
        if role == "tool":
            given["tool_call_id"] = message.get("tool_call_id")
            if not isinstance(given["tool_call_id"], str):
                raise invalid(f"messages[{i}].tool_call_id must be a string", "messages")
        out.append(given)
    return out


def _tool_calls(calls: object, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls in the one shape the client API takes (the
    arguments as JSON text, as OpenAI sends them)."""
    wrong = invalid(
        f"messages[{i}].tool_calls must be an array of "
        "{'id', 'type': 'function', 'function': {'name', 'arguments'}}",
        "messages",
    )
    if not isinstance(calls, list):
        raise wrong
    shaped = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise wrong
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # some clients send them as an object
            arguments = orjson.dumps(arguments).decode()
        shaped.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function.get("name"), "arguments": arguments},
            }
        )
    return shaped


def _only_new(messages: list[dict[str, Any]]) -> bool:
    """Whether `messages` are what a conversation's next turn adds: tool results (to its last
    reply's calls), then at most one user message."""
    *results, last = messages
    return last["role"] in ("user", "tool") and all(m["role"] == "tool" for m in results)


def _result(message: dict[str, Any]) -> dict[str, Any]:
    return {"tool_call_id": message["tool_call_id"], "content": message["content"]}


def _text(content: object, i: int) -> str:
    """A message's content: a string, or an array of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise invalid(f"messages[{i}].content must be a string or an array of text parts", "messages")
