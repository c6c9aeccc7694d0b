"""Dequantized weights kept on disk: a quantized GGUF file is dequantized once, and every later
load (a restart, each process of a multi-process deployment) reads the float32 tensors back.

Dequantizing is the most of a GGUF load on a CPU (numpy, block by block: about 3 s of the 5 s
load of SmolLM2-135M on 2 cores, more than a minute for an 8B model); reading float32 back is a
copy at the disk's or the page cache's rate.

It is opt-in, since the float32 copy takes 2-8x the file's size on disk: `PENSIEVE_WEIGHTS_CACHE`
names a folder. One file per source, under a key of its path, size, modification time and
`FORMAT` (what makes the tensors: a change to it makes new files), in the safetensors format. The
file is written as the load goes, tensor by tensor (no second copy of the model in memory), under
a temporary name renamed once whole, so a load that stops half-way, or two processes loading at
once, never leave a partial file under the key; a file that cannot be read is made again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

ENV = "PENSIEVE_WEIGHTS_CACHE"
FORMAT = "gguf-llama-f32-1"  # Hugging Face names, q and k rows unpermuted (`gguf_llama.py`)
_HEADER_ALIGN = 8


def cache_folder() -> Path | None:
    """The folder `PENSIEVE_WEIGHTS_CACHE` names (None: unset, no cache)."""
    folder = os.environ.get(ENV)
    return Path(folder).expanduser() if folder else None


def cached(
    source: Path,
    shapes: Mapping[str, tuple[int, ...]],
    make: Iterator[tuple[str, torch.Tensor]],
    folder: Path | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The float32 tensors `make` yields (named and shaped as `shapes` says, in that order), read
    from `folder`'s file for `source` if it has one, else made and written there as they go."""
    if folder is None:
        yield from make
        return
    stat = source.stat()
    key = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{FORMAT}"
    file = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"
    read = _read(file, shapes)
    if read is not None:
        logger.info("weights of %s read from %s", source, file)
        yield from read
        return
    yield from _written(file, shapes, make)


def _read(
    file: Path, shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The file's tensors, if it holds exactly `shapes` in float32; None otherwise."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        return None
    try:
        opened = safe_open(str(file), framework="pt")
    except (OSError, SafetensorError) as error:
        logger.warning("weights cache %s unreadable (%s): made again", file, error)
        return None
    with opened as handle:
        names = set(handle.keys())
        if names != set(shapes) or any(
            tuple(handle.get_slice(name).get_shape()) != shapes[name] for name in shapes
        ):
            logger.warning("weights cache %s holds other tensors: made again", file)
            return None

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(file), framework="pt") as again:
            for name in shapes:
                yield name, again.get_tensor(name)

    return tensors()


def _written(
    file: Path, shapes: Mapping[str, tuple[int, ...]], make: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`make`'s tensors, each written to `file` as it passes (safetensors: a JSON header of
    every tensor's offsets, then their bytes in the same order)."""
    header: dict[str, object] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = dict(dtype="F32", shape=list(shape), data_offsets=[offset, offset + size])
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _HEADER_ALIGN)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=file.parent, suffix=".partial")
    except OSError as error:
        logger.warning("weights cache %s not written: %s", file, error)
        yield from make
        return
    writing = True
    try:
        with os.fdopen(handle, "wb") as out:
            try:
                out.write(struct.pack("<Q", len(encoded)) + encoded)
            except OSError as error:
                writing = _stop(file, error)
            for (name, tensor), want in zip(make, shapes.items(), strict=True):
                if name != want[0] or tuple(tensor.shape) != want[1]:
                    raise ValueError(f"{name} {tuple(tensor.shape)} made where {want} was due")
                if writing:
                    values = tensor.to(torch.float32).contiguous().numpy()
                    try:
                        out.write(values.reshape(-1).view(np.uint8).data)
                    except OSError as error:  # the disk is full, say: the load goes on
                        writing = _stop(file, error)
                yield name, tensor
        if writing:
            try:
                os.replace(temporary, file)
                logger.info("weights cached in %s", file)
            except OSError as error:
                _stop(file, error)
    finally:  # a load stopped half-way, or a file not written whole: nothing under the key
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _stop(file: Path, error: OSError) -> bool:
    logger.warning("weights cache %s not written: %s", file, error)
    return False
