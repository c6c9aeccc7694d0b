"""Content keys of full KV chunks: what the cache shares between conversations (pure).

Chunk i of a token sequence is keyed by a hash chained over every full chunk before it,

    key_0 = H(seed, tokens of chunk 0),  key_i = H(key_{i-1}, tokens of chunk i),

so one key names the whole prefix up to the end of its chunk: two sequences have a chunk of
equal key exactly where their first (i + 1) * block_size tokens are equal (up to a 128-bit
collision), and the KV of those positions is the same. The seed names the namespace that may
share: the model, the tenant and an optional salt, so keys of two models or two tenants never
meet. Only full chunks have keys; the last, partial chunk of a sequence is private.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16
ChunkKey = bytes
assert array("I").itemsize == 4


def namespace(model: str, tenant: str | None = None, cache_salt: str | None = None) -> ChunkKey:
    """The seed of every chunk key of one sharing namespace."""
    # each part is length-prefixed, so no two different triples give the same bytes
    parts = (model, tenant or "", cache_salt or "")
    encoded = b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)
    return hashlib.blake2b(encoded, digest_size=DIGEST_BYTES, person=b"pensieve-ns").digest()


def chunk_key(parent: ChunkKey, tokens: Sequence[int]) -> ChunkKey:
    """The key of a chunk holding `tokens`, after the chunk keyed `parent` (or the seed)."""
    # token ids as 4-byte little-endian integers (vocabularies stay under 2**32)
    data = array("I", tokens)
    if sys.byteorder == "big":
        data.byteswap()
    return hashlib.blake2b(data.tobytes(), digest_size=DIGEST_BYTES, key=parent).digest()


def extend_keys(
    keys: list[ChunkKey], seed: ChunkKey, tokens: Sequence[int], block_size: int
) -> None:
    """Append to `keys` (those of the first len(keys) chunks of `tokens`) the keys of the
    further full chunks of `tokens`."""
    start = len(keys) * block_size
    parent = keys[-1] if keys else seed
    for begin in range(start, len(tokens) - block_size + 1, block_size):
        parent = chunk_key(parent, tokens[begin : begin + block_size])
        keys.append(parent)


def keys_of(seed: ChunkKey, tokens: Sequence[int], block_size: int) -> list[ChunkKey]:
    """The keys of every full chunk of `tokens`."""
    keys: list[ChunkKey] = []
    extend_keys(keys, seed, tokens, block_size)
    return keys
