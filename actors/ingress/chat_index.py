"""Which conversation a stateless client's chat continues (no I/O).

An OpenAI client sends the whole chat every time and names no conversation. The HTTP ingress
remembers, for each turn it answered, the whole chat after it (its messages and the reply) and
the conversation that holds its KV; a request whose messages before the last one are such a
chat is sent as the next turn of that conversation, with all its messages, so the engine
reuses the KV up to the first token where they differ (the client API's stateless path). A
guess is only a hint: the output never depends on it, and a guessed conversation that is busy or
gone is answered by starting a new one (see `actors/ingress/http_actor.py`).

Chats are keyed by tenant, so no tenant's chat ever leads to another's conversation, and kept
as SHA-256 digests, least recently used out past `capacity`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson

Message = dict[str, Any]
CAPACITY = 1 << 16  # chats remembered: 64 bytes of digest and an id each


class ChatIndex:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[bytes, str] = OrderedDict()

    def find(self, tenant: str | None, messages: Sequence[Message]) -> str | None:
        """The conversation whose last turn ended with the messages before the chat's new
        ones (None: none known)."""
        last = len(messages) - 1  # the chat's new messages: tool results, or the user's
        while last > 0 and messages[last - 1]["role"] == "tool":
            last -= 1
        if last < 2 or messages[last - 1]["role"] != "assistant":
            return None  # no earlier turn to continue
        key = _key(tenant, messages[:last])
        found = self._ids.get(key)
        if found is not None:
            self._ids.move_to_end(key)
        return found

    def remember(
        self, tenant: str | None, messages: Sequence[Message], reply: Message, conv_id: str
    ) -> None:
        """A turn of `conv_id` answered `messages` with `reply` (the assistant's message, as
        the client will send it back)."""
        key = _key(tenant, [*messages, reply])
        self._ids[key] = conv_id
        self._ids.move_to_end(key)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


def _key(tenant: str | None, messages: Sequence[Message]) -> bytes:
    chat = orjson.dumps([tenant, list(messages)], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(chat).digest()
