"""CUDA graphs of pure-decode steps: one graph per (padded batch, context bucket).

A decode step launches ~20 kernels per layer; at small batches the host cannot issue them as fast
as the GPU runs them. A captured graph replays the whole forward (and the logits) in one launch.

Graphs are keyed by the batch size padded up to a bucket and by the longest context rounded up to
a power of two: the attention kernel's launch shape (its KV split) depends on both, and stays
correct for every shorter context. Padding rows decode position 0 of a scratch block that no
conversation owns, so they write and read nothing real.

A capture takes tens of milliseconds of the host, and every running request waits for it: a
server captures every graph it can use at start-up (`capture_all`), not when a batch or context
first reaches a new bucket. All graphs write their logits into one buffer (rows [:batch] of the
largest batch's), so the memory they keep does not grow with the number of context buckets; a
graph's logits are valid until the next replay of any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pensieve.actors.wire.step import StepPlan
from pensieve.kernels import AttentionImpl, AttentionMetadata
from pensieve.kernels.metadata import pad_tables, upload
from pensieve.models.attention import PagedAttention
from pensieve.models.loader import CausalLM

# a capture spans a whole forward: other threads of the process (the event loop, NCCL's
# watchdog, the disk tier's writer waiting for a copy) may call the CUDA API meanwhile, which a
# process-wide capture would refuse, and the capture and that call would both fail
CAPTURE_MODE = "thread_local"

BATCH_BUCKETS = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    160,
    192,
    224,
    256,
    288,
    320,
    352,
    384,
    416,
    448,
    480,
    512,
)
MIN_CONTEXT_BUCKET = 512


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    slots: torch.Tensor  # [B] int64
    logits: torch.Tensor  # [B, vocab] float32
    # every tensor the graph reads must outlive it: the metadata holds cu_query_lens
    meta: AttentionMetadata | None = None


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        scratch_block: int,
        block_size: int,
        max_context: int,
        scale: float,
        impl: AttentionImpl,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.max_context = max_context
        self.scale = scale
        self.impl = impl
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        # every graph's logits rows; replaced by a larger one if a larger batch is captured
        # (graphs captured before keep theirs)
        self._logits = torch.empty(0)

    def fits(self, plan: StepPlan) -> bool:
        pieces = plan.pieces
        return (
            0 < len(pieces) <= BATCH_BUCKETS[-1]
            and not plan.orders.swap_in  # per-layer swap-in waits are not captured
            and all(p.end - p.start == 1 and p.sampling is not None for p in pieces)
            and max(p.end for p in pieces) <= self.max_context
        )

    def logits(
        self, plan: StepPlan, feed: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Logits [len(plan.pieces), vocab] of a pure-decode plan (see `fits`); `feed` may
        rewrite the graph's input ids on the device (one row per piece) before the replay."""
        pieces = plan.pieces
        batch = next(b for b in BATCH_BUCKETS if b >= len(pieces))
        longest = max(p.end for p in pieces)
        context = max(MIN_CONTEXT_BUCKET, 1 << (longest - 1).bit_length())
        context = min(context, self._round_up(self.max_context))
        key = (batch, context)
        graph = self.graphs.get(key) or self._capture(batch, context)
        width = graph.block_tables.shape[1]
        pad = batch - len(pieces)
        scratch, size = self.scratch_block, self.block_size
        tables = pad_tables([p.block_table for p in pieces] + [()] * pad, width, scratch)
        slots = [p.block_table[p.start // size] * size + p.start % size for p in pieces]
        rows = np.array(  # every input in one pinned copy: nothing waits for the device
            [
                [p.token_ids[0] for p in pieces] + [0] * pad,
                [p.start for p in pieces] + [0] * pad,
                [p.end for p in pieces] + [1] * pad,
                slots + [scratch * size] * pad,
            ],
            dtype=np.int64,
        )
        host = torch.from_numpy(np.concatenate([rows.ravel(), tables.ravel().astype(np.int64)]))
        inputs = upload(host, graph.ids.device)
        graph.ids.copy_(inputs[:batch])
        graph.positions.copy_(inputs[batch : 2 * batch])
        graph.seq_lens.copy_(inputs[2 * batch : 3 * batch])
        graph.slots.copy_(inputs[3 * batch : 4 * batch])
        graph.block_tables.copy_(inputs[4 * batch :].view(batch, width))
        if feed is not None:
            feed(graph.ids)
        graph.graph.replay()
        return graph.logits[: len(pieces)]

    def capture_all(self, max_batch: int, max_context: int | None = None) -> int:
        """Capture every graph a run with at most `max_batch` decodes attending to at most
        `max_context` positions (default: the model's) can use, the largest batch first (its
        logits buffer then serves all); returns how many there are."""
        longest = min(self.max_context, max_context or self.max_context)
        contexts = {self._round_up(n) for n in range(1, longest + 1, MIN_CONTEXT_BUCKET)}
        contexts.add(self._round_up(longest))
        batches = [b for b in BATCH_BUCKETS if b < max_batch] + [
            next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
        ]
        keys = [(b, c) for b in reversed(batches) for c in sorted(contexts)]
        for batch, context in keys:
            if (batch, context) not in self.graphs:
                self._capture(batch, context)
        return len(keys)

    def _round_up(self, n: int) -> int:
        return max(MIN_CONTEXT_BUCKET, 1 << (n - 1).bit_length())

    def _capture(self, batch: int, context: int) -> _Graph:
        device = self.kv_caches[0].device
        width = -(-context // self.block_size)
        g = _Graph(
            graph=torch.cuda.CUDAGraph(),
            ids=torch.zeros(batch, dtype=torch.long, device=device),
            positions=torch.zeros(batch, dtype=torch.long, device=device),
            seq_lens=torch.ones(batch, dtype=torch.int32, device=device),
            block_tables=torch.full(
                (batch, width), self.scratch_block, dtype=torch.int32, device=device
            ),
            slots=torch.full(
                (batch,), self.scratch_block * self.block_size, dtype=torch.long, device=device
            ),
            logits=torch.empty(0),
        )
        meta = AttentionMetadata(
            cu_query_lens=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=g.seq_lens,
            block_tables=g.block_tables,
            slot_mapping=g.slots,
            max_query_len=1,
            max_seq_len=context,
            block_size=self.block_size,
            query_lens_host=(1,) * batch,
            seq_lens_host=(context,) * batch,
        )
        g.meta = meta
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            attn = PagedAttention(self.kv_caches, meta, self.scale, impl=self.impl)
            warm = self.model.compute_logits(self.model(g.ids, g.positions, attn))
        torch.cuda.current_stream().wait_stream(side)
        # a backend of its own: its attention plan (split buffers included) is then allocated
        # inside the capture, in the graphs' pool, not kept from the warm-up outside it
        attn = PagedAttention(self.kv_caches, meta, self.scale, impl=self.impl)
        if self._logits.shape[0] < batch:
            self._logits = torch.empty((batch, warm.shape[1]), dtype=warm.dtype, device=device)
        del warm
        g.logits = self._logits[:batch]
        with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
            g.logits.copy_(self.model.compute_logits(self.model(g.ids, g.positions, attn)))
        self.graphs[(batch, context)] = g
        return g
