"""NATS subject names of the client API (version 1)."""

PREFIX = "pensieve.v1"
CHAT = f"{PREFIX}.chat"
CONVERSATIONS_GET = f"{PREFIX}.conversations.get"
CONVERSATIONS_DELETE = f"{PREFIX}.conversations.delete"
CONVERSATIONS_LIST = f"{PREFIX}.conversations.list"
