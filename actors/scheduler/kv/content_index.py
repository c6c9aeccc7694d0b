"""The content index: sealed full chunks by content key, and each chunk's users (pure).

A chunk is sealed once its KV is known and full (the manager seals a conversation's chunks when
its turn ends or is suspended); from then on a conversation whose token log has the same prefix
may use it instead of a chunk of its own. There is one sealed chunk per key. Only sealed chunks
have more than one user; they are ranked for eviction one by one (`eviction.Ranking`), apart
from the chunks of a single conversation, which are ranked as a chain.
"""

from __future__ import annotations

from pensieve.actors.scheduler.kv.kv_cache import Chunk, ConversationKV
from pensieve.actors.wire.chunk_keys import ChunkKey


class ContentIndex:
    def __init__(self) -> None:
        self.by_key: dict[ChunkKey, Chunk] = {}
        self.shared: dict[int, Chunk] = {}  # id -> chunk, for chunks with more than one user

    def get(self, key: ChunkKey) -> Chunk | None:
        return self.by_key.get(key)

    def seal(self, chunk: Chunk, key: ChunkKey) -> None:
        """`chunk` is the one chunk of content `key` from now on."""
        assert chunk.key is None and key not in self.by_key
        chunk.key = key
        self.by_key[key] = chunk

    def unseal(self, chunk: Chunk) -> None:
        """`chunk` will be written: no conversation may find it any more (it has one user)."""
        assert len(chunk.users) <= 1
        if chunk.key is not None:
            del self.by_key[chunk.key]
            chunk.key = None

    def add_user(self, chunk: Chunk, conv: ConversationKV) -> None:
        assert conv.conv_id not in chunk.users
        assert chunk.key is not None or not chunk.users, "only sealed chunks are shared"
        chunk.users[conv.conv_id] = conv
        if len(chunk.users) == 2:
            self.shared[id(chunk)] = chunk

    def remove_user(self, chunk: Chunk, conv: ConversationKV) -> bool:
        """Take `conv` off the chunk's users; True if it has none left (it leaves the index)."""
        del chunk.users[conv.conv_id]
        if len(chunk.users) == 1:
            del self.shared[id(chunk)]
            (last,) = chunk.users.values()
            last.maybe_on_gpu = last.maybe_on_cpu = True  # its own again: back in its chain
        if chunk.users:
            return False
        self.unseal(chunk)
        return True
