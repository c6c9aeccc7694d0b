"""Durable state in LMDB: each conversation's token log and turn records, and the CPU spill index.

Only this package imports `lmdb`.
"""

from pensieve.store.conversation_store import DEFAULT_MAP_SIZE, ConversationStore
from pensieve.store.records import (
    MAX_CONVERSATION_ID_CHARS,
    ConversationMeta,
    Messages,
    TurnRecord,
    validate_conversation_id,
)
from pensieve.store.writer import StoreWriter

__all__ = [
    "DEFAULT_MAP_SIZE",
    "MAX_CONVERSATION_ID_CHARS",
    "ConversationMeta",
    "ConversationStore",
    "Messages",
    "StoreWriter",
    "TurnRecord",
    "validate_conversation_id",
]
