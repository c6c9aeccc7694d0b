"""OpenAI's Conversations API objects in terms of Pensieve's conversations (no I/O).

A conversation over HTTP is a conversation of the NATS API (`pensieve.v1.conversations.*`),
under its own id. Its items are its chat as the next turn continues it: the messages it was
made with, each turn's input and reply; an item's id is its place in that chat (`msg_<index>`;
a tool's result `fco_<index>`, an assistant's calls `fc_<index>_<k>`), so a turn that edits the
chat (a response whose `instructions` change the system message) renumbers the items after the
edit. Lists page as OpenAI's do: `limit` (1 to 100, default 20), `after` an item id, `order`
`asc` or `desc` (default).
"""

from __future__ import annotations

from typing import Any

from pensieve.actors.ingress.openai_api import invalid

Message = dict[str, Any]
MAX_LIMIT = 100


def conversation(conv_id: str, created_at: float) -> dict[str, Any]:
    return {"id": conv_id, "object": "conversation", "created_at": int(created_at), "metadata": {}}


def deleted(conv_id: str) -> dict[str, Any]:
    return {"id": conv_id, "object": "conversation.deleted", "deleted": True}


def _items(index: int, message: Message) -> list[dict[str, Any]]:
    """A message of the chat as conversation items: a tool's result as a
    `function_call_output`; an assistant's as its text (if it has some, or no calls), then
    its calls as `function_call`s."""
    if message["role"] == "tool":
        output = {"type": "function_call_output", "id": f"fco_{index}", "status": "completed"}
        return [{**output, "call_id": message["tool_call_id"], "output": message["content"]}]
    calls = [
        {
            "type": "function_call",
            "id": f"fc_{index}_{k}",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        for k, call in enumerate(message.get("tool_calls") or ())
    ]
    if calls and not message["content"]:
        return calls
    kind = "output_text" if message["role"] == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": message["content"]}
    if kind == "output_text":
        part["annotations"] = []
    text = {
        "type": "message",
        "id": f"msg_{index}",
        "status": "completed",
        "role": message["role"],
        "content": [part],
    }
    return [text, *calls]


def page(chat: list[Message], query: dict[str, str]) -> dict[str, Any]:
    """A page of `chat`'s items, as `limit`, `after` and `order` in `query` ask."""
    limit = _limit(query.get("limit", "20"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", "order")
    items = [shown for i, message in enumerate(chat) for shown in _items(i, message)]
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise invalid(f"no item '{after}' in this list", "after")
        items = items[ids.index(after) + 1 :]
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


def _limit(text: str) -> int:
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_LIMIT):
        raise invalid(f"'limit' must be an integer in [1, {MAX_LIMIT}]", "limit")
    return int(text)
