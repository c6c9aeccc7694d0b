"""The client API's request and reply bodies as JSON Schema, generated from the types that parse
and write them (`actors/wire/schemas.py`, `actors/wire/replies.py`). `python -m
pensieve.actors.wire.json_schema` prints what docs/schemas/client-api.json holds."""

from __future__ import annotations

import inspect
import json
from typing import Any

import msgspec

from pensieve.actors.wire import replies, schemas, subjects

# the body each client subject takes
REQUESTS: dict[str, type[msgspec.Struct]] = {
    subjects.CHAT: schemas.ChatBody,
    subjects.CHAT_CANCEL: schemas.ConversationRef,
    subjects.CONVERSATIONS_GET: schemas.GetRequest,
    subjects.CONVERSATIONS_DELETE: schemas.ConversationRef,
    subjects.CONVERSATIONS_LIST: schemas.Page,
    subjects.CONVERSATIONS_CREATE: schemas.CreateBody,
    subjects.STATS: schemas.StatsRequest,
}
# the declared answers: a chat turn's reply and streamed deltas, the conversations subjects',
# cancels and refusals
REPLIES: dict[str, type[msgspec.Struct]] = {
    "chat": replies.ChatReply,
    "chat.delta": replies.ChatDelta,
    "chat.cancel": replies.CancelReply,
    "conversations.get": replies.ConversationReply,
    "conversations.list": replies.ListReply,
    "conversations.delete": replies.DeleteReply,
    "conversations.create": replies.CreateReply,
    "error": schemas.ErrorReply,
}


def client_api() -> dict[str, Any]:
    """One JSON Schema document: `requests` by subject, `replies` by kind, their types in
    `$defs`."""
    kinds = [*REQUESTS.values(), *REPLIES.values()]
    refs, defs = msgspec.json.schema_components(kinds, ref_template="#/$defs/{name}")
    requests = dict(zip(REQUESTS, refs[: len(REQUESTS)], strict=True))
    replies = dict(zip(REPLIES, refs[len(REQUESTS) :], strict=True))
    for schema in defs.values():  # the docstrings, without their indentation
        if "description" in schema:
            schema["description"] = inspect.cleandoc(schema["description"])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Pensieve client API (NATS, v1)",
        "requests": requests,
        "replies": replies,
        "$defs": dict(sorted(defs.items())),
    }


def render() -> str:
    return json.dumps(client_api(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")
