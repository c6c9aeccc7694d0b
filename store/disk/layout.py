"""The disk tier's on-disk format: slot geometry, the index's records and chunk checksums.

A slot holds one chunk's KV as the CPU tier lays it out, layer after layer; each layer's part is
one block of the CPU tier's per-layer tensor [num_blocks, 2, block_size, Hkv, D]:

    slots.bin, slot s at byte s * slot_bytes:
    | layer 0: K, V | layer 1: K, V | ... | layer L-1: K, V | zeros up to ALIGN |
    |<- layer_bytes ->|
    |<------------------- chunk_bytes ------------------->|
    |<---------------------------- slot_bytes ----------------------------->|

Slots start and end on ALIGN, so direct I/O can move them. The index (LMDB, see `index.py`)
keeps, per chunk, a checksum of its bytes seeded with its content key: bytes that are torn,
corrupt or another chunk's never pass as this chunk.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

LAYOUT_VERSION = 1  # raised whenever the slot layout or a record below changes
ALIGN = 4096  # slot offsets and lengths: a multiple of every logical block size in use
KEY_BYTES = 16  # a chunk's content key (`actors/wire/chunk_keys.py`)
FINGERPRINT_BYTES = 16

# the index's records, little-endian
_HEADER = struct.Struct("<I16sQQQ")  # layout version, fingerprint, num_layers, layer_bytes, slots
_ENTRY = struct.Struct("<IQ16sH")  # slot, checksum, fingerprint, layout version
_VERSION = struct.Struct("<I")  # a header's first field, readable whatever the rest holds


def fingerprint_digest(model_fingerprint: str) -> bytes:
    """The 16 bytes that name, in the index, what a chunk's KV depends on: the caller's string
    (the model, its revision, dtype and the rank's shard)."""
    return hashlib.blake2b(
        model_fingerprint.encode(), digest_size=FINGERPRINT_BYTES, person=b"pensieve-disk"
    ).digest()


@dataclass(frozen=True)
class ChunkGeometry:
    """The bytes of one chunk: `num_layers` parts of `layer_bytes` (K and V of its tokens)."""

    num_layers: int
    layer_bytes: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.layer_bytes < 1:
            raise ValueError(f"need num_layers >= 1 and layer_bytes >= 1, got {self}")

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def slot_bytes(self) -> int:
        return -(-self.chunk_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Header:
    """What a cache directory holds, kept in its index: written when the directory is laid
    out, checked at every start."""

    layout_version: int
    fingerprint: bytes
    geometry: ChunkGeometry
    num_slots: int

    def encode(self) -> bytes:
        g = self.geometry
        return _HEADER.pack(
            self.layout_version, self.fingerprint, g.num_layers, g.layer_bytes, self.num_slots
        )

    @classmethod
    def decode(cls, data: bytes) -> Header | None:
        """The header, or None where its layout version is another one (its other fields may
        then mean something else) or it is malformed."""
        if len(data) != _HEADER.size or _VERSION.unpack_from(data)[0] != LAYOUT_VERSION:
            return None
        version, fingerprint, num_layers, layer_bytes, num_slots = _HEADER.unpack(data)
        try:
            geometry = ChunkGeometry(num_layers, layer_bytes)
        except ValueError:
            return None
        return cls(version, fingerprint, geometry, num_slots)

    def foreign_to(self, fingerprint: bytes, geometry: ChunkGeometry) -> str | None:
        """Why a directory with this header cannot serve `fingerprint`'s chunks of `geometry`,
        or None if it can."""
        if self.fingerprint != fingerprint:
            return "another model fingerprint"
        if self.geometry != geometry:
            return f"another chunk geometry ({self.geometry})"
        return None


def header_version(data: bytes) -> int | None:
    """The layout version a stored header names, whatever the rest of it holds."""
    return _VERSION.unpack_from(data)[0] if len(data) >= _VERSION.size else None


@dataclass(frozen=True)
class Entry:
    """The index's record of one chunk on disk (under its content key)."""

    slot: int
    checksum: int
    fingerprint: bytes
    layout_version: int = LAYOUT_VERSION

    def encode(self) -> bytes:
        return _ENTRY.pack(self.slot, self.checksum, self.fingerprint, self.layout_version)

    @classmethod
    def decode(cls, data: bytes) -> Entry | None:
        if len(data) != _ENTRY.size:
            return None
        return cls(*_ENTRY.unpack(data))


def checksum(key: bytes, pieces: Sequence[memoryview]) -> int:
    """xxh3-64 of a chunk's bytes (its pieces in order), seeded with its content key.

    xxh3 hashes at tens of GB/s on one core, well above a disk's rate, where crc32 and
    blake2b from the standard library would bound the tier; the seed ties the bytes to their
    key, so a slot that holds another chunk's complete bytes fails the check too."""
    digest = xxhash.xxh3_64(seed=int.from_bytes(key[:8], "little"))
    for piece in pieces:
        digest.update(piece)
    return digest.intdigest()
