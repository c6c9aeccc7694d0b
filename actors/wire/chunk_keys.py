"""Content keys of full KV chunks: what the cache shares between conversations (pure).

Chunk i of a token sequence is keyed by a hash chained over every full chunk before it,

    key_0 = H(seed, tokens of chunk 0),  key_i = H(key_{i-1}, tokens of chunk i),

so one key names the whole prefix up to the end of its chunk: two sequences have a chunk of
equal key exactly where their first (i + 1) * block_size tokens are equal (up to a 128-bit
collision), and the KV of those positions is the same. The seed names the namespace that may
share: the model, the tenant and an optional salt, so keys of two models or two tenants never
meet. Only full chunks have keys; the last, partial chunk of a sequence is private.

An operator may name some prompts public (`PublicKeys`): their chunks are keyed from a seed of
the model alone, and a namespace that may use them (`Namespace`) keys a leading run of such
chunks with those public keys, the same for every tenant:

    public chunks:   p_0 = H(public seed, c_0), ..., p_{m-1} = H(p_{m-2}, c_{m-1})
    the next chunk:  key_m = H(A(seed, p_{m-1}), c_m),  key_i = H(key_{i-1}, c_i) after it

so what follows a public prefix is keyed in the tenant's namespace (A mixes its seed with the
public prefix's last key) and every key still names the whole prefix.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DIGEST_BYTES = 16
ChunkKey = bytes
assert array("I").itemsize == 4


def namespace(model: str, tenant: str | None = None, cache_salt: str | None = None) -> ChunkKey:
    """The seed of every chunk key of one sharing namespace."""
    # each part is length-prefixed, so no two different triples give the same bytes
    parts = (model, tenant or "", cache_salt or "")
    encoded = b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)
    return hashlib.blake2b(encoded, digest_size=DIGEST_BYTES, person=b"pensieve-ns").digest()


def public_seed(model: str) -> ChunkKey:
    """The seed of the public prompts' chunk keys: the model's alone, hashed apart from every
    tenant's `namespace` (another personalization), so it is no tenant's seed."""
    return hashlib.blake2b(
        model.encode(), digest_size=DIGEST_BYTES, person=b"pensieve-pub"
    ).digest()


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
    _chain(keys, keys[-1] if keys else seed, tokens, block_size)


def keys_of(seed: ChunkKey, tokens: Sequence[int], block_size: int) -> list[ChunkKey]:
    """The keys of every full chunk of `tokens`."""
    keys: list[ChunkKey] = []
    extend_keys(keys, seed, tokens, block_size)
    return keys


def _chain(keys: list[ChunkKey], parent: ChunkKey, tokens: Sequence[int], block_size: int) -> None:
    """Append the keys of the full chunks of `tokens` after the first len(keys), the first of
    them chained to `parent`."""
    for begin in range(len(keys) * block_size, len(tokens) - block_size + 1, block_size):
        parent = chunk_key(parent, tokens[begin : begin + block_size])
        keys.append(parent)


def _after_public(seed: ChunkKey, last_public: ChunkKey) -> ChunkKey:
    """The parent of the first chunk after a public prefix: the namespace's seed and the key of
    the prefix's last chunk, both (hashed apart from chunk keys by its personalization)."""
    return hashlib.blake2b(
        last_public, digest_size=DIGEST_BYTES, key=seed, person=b"pensieve-after"
    ).digest()


@dataclass(frozen=True, eq=False)
class PublicKeys:
    """The keys of every full chunk of the prompts an operator names public (and so of every
    leading run of their chunks), chained from `public_seed`."""

    seed: ChunkKey
    keys: frozenset[ChunkKey]

    @classmethod
    def of(cls, model: str, prompts: Iterable[Sequence[int]], block_size: int) -> PublicKeys:
        seed = public_seed(model)
        return cls(seed, frozenset(k for p in prompts for k in keys_of(seed, p, block_size)))


@dataclass(frozen=True)
class Namespace:
    """How a conversation's chunks are keyed: chained from `seed` (`namespace`), after a
    leading run of public prompts' chunks keyed as `public` keys them, if it may use them."""

    seed: ChunkKey
    public: PublicKeys | None = None

    def extend(self, keys: list[ChunkKey], tokens: Sequence[int], block_size: int) -> None:
        """Append to `keys` (those of the first len(keys) chunks of `tokens`) the keys of the
        further full chunks of `tokens`."""
        public = self.public
        if public is None or (keys and keys[-1] not in public.keys):  # past any public prefix
            extend_keys(keys, self.seed, tokens, block_size)
            return
        parent = keys[-1] if keys else public.seed
        for begin in range(len(keys) * block_size, len(tokens) - block_size + 1, block_size):
            key = chunk_key(parent, tokens[begin : begin + block_size])
            if key not in public.keys:
                break
            keys.append(key)
            parent = key
        if len(tokens) - len(keys) * block_size >= block_size:  # a full chunk past the prefix
            parent = _after_public(self.seed, keys[-1]) if keys else self.seed
            _chain(keys, parent, tokens, block_size)

    def first_parent(self, key: ChunkKey) -> ChunkKey:
        """What the first chunk, keyed `key`, is chained from: the public seed if it is a public
        prompt's chunk, else the namespace's. (The chunk after a public prefix is chained from
        both the seed and the prefix's last key, see `_after_public`.)"""
        public = self.public
        return public.seed if public is not None and key in public.keys else self.seed

    def keys_of(self, tokens: Sequence[int], block_size: int) -> list[ChunkKey]:
        keys: list[ChunkKey] = []
        self.extend(keys, tokens, block_size)
        return keys


def turn_namespace(
    model: str, public: PublicKeys | None, tenant: str | None, cache_salt: str | None = None
) -> Namespace:
    """How an engine serving `model` keys the chunks of a turn of `tenant` (None: the service's
    own) with `cache_salt`: turns share cached prefixes only within one namespace, apart from
    the chunks of public prompts. A salted turn shares nothing outside its salt, public prompts
    included (as a salt in vLLM's keys). The engine and the ingress's placement both key a
    prompt through this."""
    return Namespace(namespace(model, tenant, cache_salt), None if cache_salt else public)
