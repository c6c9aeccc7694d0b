"""The disk tier: chunks of KV in a preallocated slot file, mapped by an LMDB index that names
only chunks whose bytes are durable (see `tier.py` for the write order, `layout.py` and
`index.py` for the format, docs/disk-tier.md for the design)."""

from pensieve.store.disk.directory import DiskTierError
from pensieve.store.disk.layout import ALIGN, KEY_BYTES, LAYOUT_VERSION, ChunkGeometry
from pensieve.store.disk.slot_io import IoMethod, aligned_buffer
from pensieve.store.disk.tier import DiskConfig, DiskTier

__all__ = [
    "ALIGN",
    "KEY_BYTES",
    "LAYOUT_VERSION",
    "ChunkGeometry",
    "DiskConfig",
    "DiskTier",
    "DiskTierError",
    "IoMethod",
    "aligned_buffer",
]
