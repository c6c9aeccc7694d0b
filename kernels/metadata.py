"""Per-step attention metadata: built once per step, read by every layer.

A step's batch is a flat list of query tokens. They are grouped into *sub-sequences*: a contiguous
run of query tokens of one conversation whose positions are consecutive. Several sub-sequences may
share the same block-table row (a recomputed prefix and the new prompt of one turn).

    query tokens (flat):  | s0: q0 q1 q2 | s1: q0 | s2: q0 ... q7 |
    cu_query_lens:        0             3       4               12
    seq_lens[s]:          number of KV positions sub-sequence s may see, including its own tokens.
    query token i of s sits at position  seq_lens[s] - query_len(s) + i  and attends to
    KV positions 0 .. that position (causal, offset by the cached context).

The paged KV cache of one layer is a tensor [num_blocks, 2, block_size, num_kv_heads, head_dim]
(index 0 = key, 1 = value). Position p of sub-sequence s lives in block
block_tables[s, p // block_size] at offset p % block_size. slot_mapping[t] = block * block_size +
offset is where token t's new K/V is written before attention reads the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    cu_query_lens: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies, so reference code and launch heuristics never read the device
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # leading sub-sequences with one query token each (decodes; the executor puts them first)
    num_single: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_host))

    def split_singles(self) -> tuple[AttentionMetadata, AttentionMetadata] | None:
        """The leading single-token sub-sequences and the rest as two metadata, each indexing
        its own tokens from 0 (the rest's tokens start at `num_single`); None if one is empty.

        A mixed step launches attention once per part, so decodes keep decode-sized tiles
        instead of sharing the multi-token tiles the longest query needs."""
        n = self.num_single
        if not 0 < n < self.num_seqs:
            return None
        cached = self.__dict__.get("_split")
        if cached is None:
            singles = AttentionMetadata(
                self.cu_query_lens[: n + 1],
                self.seq_lens[:n],
                self.block_tables[:n],
                self.slot_mapping[:n],
                1,
                max(self.seq_lens_host[:n]),
                self.block_size,
                self.query_lens_host[:n],
                self.seq_lens_host[:n],
                n,
            )
            # the rest's tensors are copies, not views at an offset: Triton specializes a
            # kernel on whether each pointer is 16-byte aligned, and a view's alignment would
            # change with the number of decodes, compiling a new variant mid-run
            rest = AttentionMetadata(
                self.cu_query_lens[n:] - n,
                self.seq_lens[n:].clone(),
                self.block_tables[n:].clone(),
                self.slot_mapping[n:].clone(),
                max(self.query_lens_host[n:]),
                max(self.seq_lens_host[n:]),
                self.block_size,
                self.query_lens_host[n:],
                self.seq_lens_host[n:],
                0,
            )
            cached = self.__dict__["_split"] = (singles, rest)  # frozen: cache by hand
        return cached  # type: ignore[no-any-return]


def build_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the metadata for one step from host lists (one entry per sub-sequence)."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError(
            "query_lens, seq_lens and block_tables must have one entry per sub-sequence"
        )
    slots: list[int] = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if qlen < 1 or slen < qlen:
            raise ValueError(f"bad sub-sequence: query_len={qlen} seq_len={slen}")
        if len(table) * block_size < slen:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {slen} positions")
        for pos in range(slen - qlen, slen):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(t) for t in block_tables)
    cu = [0]
    for qlen in query_lens:
        cu.append(cu[-1] + qlen)
    num_seqs = len(query_lens)
    ints = torch.from_numpy(  # the int32 inputs go up in one copy
        np.concatenate(
            [
                np.asarray(cu, dtype=np.int32),
                np.asarray(seq_lens, dtype=np.int32),
                pad_tables(block_tables, max_blocks, 0).ravel(),
            ]
        )
    )
    ints = upload(ints, torch.device(device))
    return AttentionMetadata(
        cu_query_lens=ints[: num_seqs + 1],
        seq_lens=ints[num_seqs + 1 : 2 * num_seqs + 1],
        block_tables=ints[2 * num_seqs + 1 :].view(num_seqs, max_blocks),
        slot_mapping=upload(torch.tensor(slots, dtype=torch.int64), torch.device(device)),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_host=tuple(int(q) for q in query_lens),
        seq_lens_host=tuple(int(s) for s in seq_lens),
        num_single=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
    )


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, without making the host wait: a CUDA copy goes from pinned memory
    (a pageable one waits for the stream, i.e. for every step issued before it)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def pad_tables(tables: Sequence[Sequence[int]], width: int, fill: int) -> np.ndarray:
    """Block tables as one int32 array [len(tables), width]: each row cut or padded with `fill`."""
    out = np.full((len(tables), width), fill, dtype=np.int32)
    for row, table in enumerate(tables):
        n = min(len(table), width)
        out[row, :n] = table[:n]
    return out
