"""OpenAI's response bodies for the client API's replies (no I/O): the whole `chat.completion`
(or `text_completion`) object, and the chunks and server-sent events of a streamed one, for a
request that `openai_api.py` translated (`Completion`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from pensieve.actors.ingress.openai_api import Completion


def usage(*replies: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage of the client API replies to one request (one per choice): the prompt once,
    as the first choice's turn took it, and the completion tokens of all, as OpenAI counts `n`.
    `prompt_tokens_details.cached_tokens` (the prompt tokens whose KV was reused, from any tier)
    has `prompt_sources` beside it, every prompt token by where its KV came from, as the client
    API's `usage` has them."""
    used = replies[0]["usage"]
    prompt = used["prompt_tokens"]
    completion = sum(reply["usage"]["completion_tokens"] for reply in replies)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": used["cached_tokens"],
            "prompt_sources": used["prompt_sources"],
        },
    }


def completion(request: Completion, replies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The `chat.completion` (or `text_completion`) object of the whole replies, one per choice.
    A chat's choices each name their conversation, the body the first choice's."""
    body = {
        "id": request.id,
        "object": "text_completion" if request.text else "chat.completion",
        "created": request.created,
        "model": request.model,
        "choices": [_choice(request, index, reply) for index, reply in enumerate(replies)],
        "usage": usage(*replies),
    }
    if not request.text:  # a raw completion's conversation has ended with it
        body["conversation_id"] = replies[0]["conversation_id"]
    return body


def _choice(request: Completion, index: int, reply: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "logprobs": None,
        "finish_reason": reply["finish_reason"],
    }
    if request.text:
        choice["text"] = reply["text"]
    elif reply.get("tool_calls"):  # the content before the calls, if any
        choice["message"] = {
            "role": "assistant",
            "content": reply["text"] or None,
            "tool_calls": reply["tool_calls"],
        }
    else:
        choice["message"] = {"role": "assistant", "content": reply["text"]}
    if request.return_token_ids:
        choice["token_ids"] = reply["token_ids"]
    if _names_conversations(request):
        choice["conversation_id"] = reply["conversation_id"]
    return choice


def _names_conversations(request: Completion) -> bool:
    """Whether each choice names its conversation: a chat's, of several (the one to name to
    continue that choice; the response names the first's)."""
    return not request.text and request.n > 1


def first_chunks(request: Completion) -> list[dict[str, Any]]:
    """The chunks that open a stream: each choice's assistant's role (a chat's only)."""
    if request.text:
        return []
    return [chunk(request, "", role=True, index=index) for index in range(request.n)]


def chunk(
    request: Completion,
    text: str,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    role: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """One `chat.completion.chunk` (or `text_completion` chunk) of a streamed reply: `text`
    more of choice `index`, with the assistant's `role` in a chat's first."""
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason}
    if request.text:
        choice["text"] = text
    else:
        opening = {"role": "assistant"} if role else {}
        choice["delta"] = {**opening, "content": text} if text or role else {}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": request.id,
        "object": _chunk_object(request),
        "created": request.created,
        "model": request.model,
        "choices": [choice],
    }


def last_chunks(request: Completion, reply: dict[str, Any], index: int = 0) -> list[dict[str, Any]]:
    """The chunks that end choice `index`'s stream: the reply's tool calls, then the finish
    reason (with the choice's conversation, as in `completion`)."""
    ids = reply["token_ids"] if request.return_token_ids else None
    chunks = tool_call_chunks(request, reply.get("tool_calls", ()), index)
    finish = chunk(request, "", reply["finish_reason"], ids, index=index)
    if _names_conversations(request):
        finish["choices"][0]["conversation_id"] = reply["conversation_id"]
    chunks.append(finish)
    return chunks


def usage_chunk(request: Completion, replies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The chunk after every choice's last (`stream_options.include_usage`): the usage."""
    return {
        "id": request.id,
        "object": _chunk_object(request),
        "created": request.created,
        "model": request.model,
        "choices": [],
        "usage": usage(*replies),
    }


def tool_call_chunks(
    request: Completion, calls: Sequence[dict[str, Any]], index: int = 0
) -> list[dict[str, Any]]:
    """A reply's tool calls as OpenAI streams them: for each, a chunk with its index, id and
    function name (arguments ""), then its arguments."""
    deltas: list[dict[str, Any]] = []
    for number, call in enumerate(calls):
        function = call["function"]
        opening = {"name": function["name"], "arguments": ""}
        deltas.append({"index": number, "id": call["id"], "type": "function", "function": opening})
        deltas.append({"index": number, "function": {"arguments": function["arguments"]}})
    chunks = []
    for delta in deltas:
        body = chunk(request, "", index=index)
        body["choices"][0]["delta"] = {"tool_calls": [delta]}
        chunks.append(body)
    return chunks


def _chunk_object(request: Completion) -> str:
    return "text_completion" if request.text else "chat.completion.chunk"


def event(body: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"
