"""CUDA graphs for steps that are not pure decodes: everything but attention, per token bucket.

A step with prompt tokens, a recomputed prefix or a swap-in cannot replay a decode graph
(actors/cuda_graphs.py): its attention depends on how its tokens split into sequences. Issued
eagerly, its forward is ~20 kernels a layer from Python, and at 13B with a few hundred tokens the
host takes about as long to issue them as the GPU to run them. Everything outside attention works
token by token, though, so it depends only on the number of tokens. The forward is cut at
attention into L + 1 pieces, each captured once per token bucket:

    piece 0   embedding, RoPE tables, layer 0 up to q/k/v (its K/V written to the cache)
    piece i   layer i-1 after attention (o_proj, residual, MLP), layer i up to q/k/v
    piece L   layer L-1 after attention, final norm

Between pieces the host launches only attention, on the step's real tokens and metadata. Pieces
read and write fixed buffers sized for the largest bucket. Padding rows carry token 0 at position
0 and write their K/V to the scratch slot no conversation owns; no operation in a piece mixes
rows, so padding never reaches a real token.

Piece i writes layer i's K/V, so a pipelined swap-in's wait for layer i comes before piece i
(after layer i-1's attention), not before attention i: the copy of a returning conversation's
last, partly filled block must land before the new tokens are written into it.

Without CUDA the same pieces run uncaptured, so the CPU tests check the buffers and the padding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pensieve.kernels import AttentionImpl, AttentionMetadata, paged_attention, write_kv
from pensieve.models.llama import LlamaModel

SMALL_BUCKETS = (8, 16, 32, 64)
BUCKET_STEP = 64  # token buckets from 128 up grow by this much: padding stays below 64 tokens


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Padded token counts a step of at most `max_tokens` tokens may take."""
    small = [b for b in SMALL_BUCKETS if b < max_tokens]
    return (*small, *range(2 * SMALL_BUCKETS[-1], max_tokens, BUCKET_STEP), max_tokens)


class PiecewiseGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        scratch_slot: int,
        max_tokens: int,
        scale: float,
        impl: AttentionImpl,
    ) -> None:
        cfg = model.config
        device, dtype = kv_caches[0].device, kv_caches[0].dtype
        self.model = model
        self.kv_caches = kv_caches
        self.scratch_slot = scratch_slot
        self.scale = scale
        self.impl = impl
        self.capture = device.type == "cuda"
        self.buckets = token_buckets(max_tokens)
        width = self.buckets[-1]
        # ids, positions and slots of a bucket of `size` tokens: inputs[:3 * size], packed, so
        # one copy from pinned memory moves them
        self.inputs = torch.zeros(3 * width, dtype=torch.long, device=device)
        self.staging = torch.zeros(3 * width, dtype=torch.long, pin_memory=self.capture)
        self._staged: torch.cuda.Event | None = None  # the last copy out of `staging`

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.x = buffer(width, cfg.hidden_size)  # the residual stream
        self.cos, self.sin = buffer(width, cfg.head_dim), buffer(width, cfg.head_dim)
        self.q = buffer(width, cfg.num_heads, cfg.head_dim)
        self.attn_out = buffer(width, cfg.num_heads, cfg.head_dim)
        self.hidden = buffer(width, cfg.hidden_size)  # after the final norm
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.pieces: dict[int, list[Callable[[], None]]] = {}

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.buckets[-1]

    def forward(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        meta: AttentionMetadata,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's T tokens (see `fits`); `meta` describes them."""
        n = len(token_ids)
        size = next(b for b in self.buckets if b >= n)
        pieces = self.pieces.get(size) or self._prepare(size)  # before staging: capture runs
        self._stage(size, token_ids, positions, slots)
        num_layers = len(pieces) - 1
        for i, piece in enumerate(pieces):
            if i < num_layers and before_layer is not None:
                before_layer(i)  # piece i writes layer i's K/V
            piece()
            if i < num_layers:
                paged_attention(self.q[:n], self.kv_caches[i], meta, self.scale, self.impl,
                                out=self.attn_out[:n])  # fmt: skip
        return self.hidden[:n]

    def capture_all(self) -> int:
        """Capture every bucket now (a warm-up, so none is captured in a measured step)."""
        for size in self.buckets:
            if size not in self.pieces:
                self._prepare(size)
        return len(self.buckets)

    def _stage(
        self, size: int, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int]
    ) -> None:
        n = len(token_ids)
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.staging.numpy()
        host[:n], host[n:size] = token_ids, 0
        host[size : size + n], host[size + n : 2 * size] = positions, 0
        host[2 * size : 2 * size + n], host[2 * size + n : 3 * size] = slots, self.scratch_slot
        self.inputs[: 3 * size].copy_(self.staging[: 3 * size], non_blocking=True)
        if self.capture:
            self._staged = torch.cuda.Event()
            self._staged.record()

    def _prepare(self, size: int) -> list[Callable[[], None]]:
        """The L + 1 pieces of bucket `size`: captured graphs on CUDA, plain calls elsewhere."""
        # the pieces run before anything is staged: make every row a padding row, so that
        # warming up and capturing write K/V only to the scratch slot
        pad = np.zeros(3 * size, dtype=np.int64)
        pad[2 * size :] = self.scratch_slot
        self.inputs[: 3 * size].copy_(torch.from_numpy(pad))
        count = len(self.model.layers) + 1
        calls: list[Callable[[], None]] = [
            functools.partial(self._run_piece, i, size) for i in range(count)
        ]
        if not self.capture:
            self.pieces[size] = calls
            return calls
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for call in calls:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                call()
            graphs.append(graph.replay)
        self.pieces[size] = graphs
        return graphs

    def _run_piece(self, i: int, size: int) -> None:
        model = self.model
        x = self.x[:size]
        cos, sin = self.cos[:size], self.sin[:size]
        if i == 0:
            embedded, c, s = model.embed(self.inputs[:size], self.inputs[size : 2 * size])
            x.copy_(embedded)
            cos.copy_(c)
            sin.copy_(s)
        else:
            x.copy_(model.layers[i - 1].post_attention(x, self.attn_out[:size]))
        if i == len(model.layers):
            self.hidden[:size].copy_(model.norm(x))
            return
        q, k, v = model.layers[i].pre_attention(x, cos, sin)
        write_kv(k, v, self.kv_caches[i], self.inputs[2 * size : 3 * size], self.impl)
        self.q[:size].copy_(q)
