"""Reading a GGUF file (llama.cpp's model format, versions 2 and 3) in one pass over an mmap.

gguf-py's `GGUFReader` builds numpy views for every part of every metadata value, several per
string, so a file with a 50k-token vocabulary and as many merges takes seconds just to open.
Here string arrays are decoded in one tight loop of `struct` reads, numeric arrays are one
`numpy.frombuffer` each, and tensor data stay untouched in the mapping until dequantized. The
block formats themselves are left to gguf-py (`dequantize`, `GGML_QUANT_SIZES`), which llama.cpp
keeps in step with its own kernels.

Layout, all little-endian: magic "GGUF", u32 version, u64 tensor count, u64 key/value count;
the key/values (string key, u32 value type, value); the tensor infos (string name, u32 number of
dims, u64 dims innermost first, u32 ggml type, u64 offset from the start of the data); padding to
`general.alignment` (32 if absent); the tensor data, each tensor at an aligned offset. A string
is a u64 byte length and UTF-8 bytes; an array is a u32 item type, a u64 count and the items.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format of one scalar; 8 (string) and 9 (array) are handled apart
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """A file this reader cannot take: not GGUF, an unsupported version, or truncated/corrupt."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor; `data` is its bytes as stored (a view), shaped (*shape[:-1], row bytes)."""

    name: str
    shape: tuple[int, ...]  # torch order, outermost first (the file lists dims innermost first)
    ggml_type: GGMLQuantizationType
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The values as float32 of `shape` (a view into the file for F32 tensors)."""
        values = dequantize(self.data, self.ggml_type)
        return values.astype(np.float32, copy=False).reshape(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    """What a GGUF file holds: its metadata and its tensors, in file order."""

    path: Path
    version: int
    metadata: Mapping[str, Any]  # str, int, float, bool, or a list of those
    tensors: Mapping[str, GGUFTensor]
    alignment: int
    data_offset: int  # where the tensor data start; tensor offsets count from here


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`. GGUFError (a ValueError) for anything but a well-formed little-endian v2/v3."""
    path = Path(path)
    with open(path, "rb") as file:
        try:
            # A private copy-on-write mapping: the views are writable (torch.from_numpy wants that)
            # while the file itself can never change through them.
            buf = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as e:  # an empty file cannot be mapped
            raise GGUFError(f"{path}: not a GGUF file ({e})") from None
    try:
        return _Parser(buf, path).parse()
    except (struct.error, UnicodeDecodeError, IndexError) as e:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({e})") from None


class _Parser:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.view = memoryview(buf)
        self.path = path
        self.pos = 0

    def parse(self) -> GGUFFile:
        if self.buf[:4] != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self.buf[:4])!r})")
        self.pos = len(MAGIC)
        version = self._u32()
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            why = "a big-endian file" if swapped in SUPPORTED_VERSIONS else f"version {version}"
            raise GGUFError(f"{self.path}: unsupported GGUF file ({why}; little-endian v2/v3 only)")
        tensor_count, kv_count = self._count(), self._count()
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment < 1:
            raise GGUFError(f"{self.path}: general.alignment must be >= 1, got {alignment}")
        data_offset = -(-self.pos // alignment) * alignment
        tensors = {
            name: self._tensor(name, dims, ggml_type, data_offset + offset)
            for name, dims, ggml_type, offset in infos
        }
        return GGUFFile(self.path, version, metadata, tensors, alignment, data_offset)

    # ---- scalars and strings -----------------------------------------------------------------

    def _u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def _count(self) -> int:
        """A u64 count, checked against the bytes left so a corrupt one fails fast."""
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        if value > len(self.buf) - self.pos:
            raise GGUFError(f"{self.path}: count {value} at byte {self.pos - 8} exceeds the file")
        return int(value)

    def _string(self) -> str:
        length = self._count()
        start, self.pos = self.pos, self.pos + length
        return str(self.view[start : self.pos], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            return self._array()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown value type {kind} at byte {self.pos - 4}")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _array(self) -> list[Any]:
        kind, count = self._u32(), self._count()
        if kind == _STRING:
            return self._strings(count)
        if kind == _ARRAY:
            return [self._array() for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown array item type {kind} at byte {self.pos - 12}")
        items = np.frombuffer(self.buf, np.dtype("<" + fmt), count, self.pos)
        self.pos += items.nbytes
        values: list[Any] = items.tolist()
        return values

    def _strings(self, count: int) -> list[str]:
        # The hot loop of the whole parse (the vocabulary and merges), so locals only.
        view, unpack, pos = self.view, _U64.unpack_from, self.pos
        out: list[str] = [""] * count
        for i in range(count):
            (length,) = unpack(view, pos)
            pos += 8
            out[i] = str(view[pos : pos + length], "utf-8")
            pos += length
        if pos > len(view):
            raise GGUFError(f"{self.path}: string array runs past the end of the file")
        self.pos = pos
        return out

    # ---- tensors -----------------------------------------------------------------------------

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._u32()
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
        self.pos += 8 * n_dims
        ggml_type = self._u32()
        (offset,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return name, tuple(int(d) for d in reversed(dims)), ggml_type, int(offset)

    def _tensor(self, name: str, shape: tuple[int, ...], type_id: int, start: int) -> GGUFTensor:
        try:
            ggml_type = GGMLQuantizationType(type_id)
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type {type_id}") from None
        if not shape or shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {name} of shape {shape} is not whole blocks")
        row_bytes = shape[-1] // block * block_bytes
        rows = math.prod(shape[:-1])
        if start + rows * row_bytes > len(self.buf):
            raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
        data = np.frombuffer(self.buf, np.uint8, rows * row_bytes, start)
        return GGUFTensor(name, shape, ggml_type, data.reshape(*shape[:-1], row_bytes))
