"""CUDA graphs of steps with prefill pieces: the forward captured in pieces cut at attention.

A step that prefills runs attention over sub-sequences whose number, lengths and contexts change
from step to step, so its attention launches cannot be captured once for every step of a size.
Everything else depends only on the number of tokens: the embedding, every matrix product, norm
and all-reduce, RoPE and the K/V write. So, per token bucket, the forward is captured as L + 1
graphs, cut just before each layer's attention, which runs eagerly between them over the step's
own metadata (vLLM's piecewise graphs):

    graph 0      embedding, RoPE tables, layer 0 up to its K/V write     -> q_in
    eager        attention of layer 0 over the paged cache               q_in -> out
    graph 1      layer 0 from out (o_proj, all-reduce, MLP, all-reduce),
                 layer 1 up to its K/V write                             -> q_in
    ...
    graph L      layer L-1 from out, the final norm                      -> hidden

An eager Llama layer launches ~12 kernels (14 with two all-reduces under tensor parallelism);
here it is one graph and one or two attention launches. Rows past the step's tokens (up to the
bucket) compute on stale inputs and write their K/V into the scratch block, which no conversation
owns; no kernel mixes rows but attention, which reads the step's rows alone.

Every bucket's graphs share one memory pool: the buckets never run interleaved, so one bucket's
intermediates may reuse another's memory. The tensors that cross a cut (q_in, out, the step's
inputs) are allocated once, outside the pool, at the largest bucket's size.

`ExecutorConfig.mixed_graphs` off runs such steps eagerly instead (for side-by-side benchmarks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pensieve.actors.executor.cuda_graphs import CAPTURE_MODE
from pensieve.kernels import AttentionImpl, write_kv
from pensieve.kernels.fused import rope_write_kv
from pensieve.models.attention import PagedAttention
from pensieve.models.loader import CausalLM

# padded step sizes in tokens: fine where a step is memory-bound (padding rows are nearly free
# there), within an eighth of the step above
TOKEN_BUCKETS = (
    8,
    16,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    320,
    384,
    448,
    512,
    640,
    768,
    896,
    1024,
    1280,
    1536,
    1792,
    2048,
)


@dataclass
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph]  # num_layers + 1, replayed in order
    hidden: torch.Tensor  # [bucket, hidden]: the last graph's output


class _Cut:
    """The attention backend while a bucket is captured: each layer's K/V goes into the cache
    at the static slots, its queries into `q_in`, and `cut()` ends the graph being captured and
    begins the next; the layer then reads `out`, which the eager attention fills at replay."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        slots: torch.Tensor,  # [bucket] int64
        q_in: torch.Tensor,  # [bucket, Hq, D]
        out: torch.Tensor,  # [bucket, Hq, D]
        impl: AttentionImpl,
    ) -> None:
        self.kv_caches = kv_caches
        self.slots = slots
        self.q_in = q_in
        self.out = out
        self.impl = impl
        self.cut: Callable[[], None] = lambda: None
        self.num_cuts = 0

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        write_kv(k, v, self.kv_caches[layer_idx], self.slots, self.impl)
        return self._attention_output(q)

    def attend_qkv(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        num_q_heads: int,
    ) -> torch.Tensor:
        cache = self.kv_caches[layer_idx]
        q = rope_write_kv(qkv, cos, signed_sin, cache, self.slots, num_q_heads, self.impl)
        return self._attention_output(q)

    def _attention_output(self, q: torch.Tensor) -> torch.Tensor:
        self.q_in.copy_(q)
        self.cut()
        self.num_cuts += 1
        return self.out


class PiecewiseGraphs:
    """Replays a step of up to `TOKEN_BUCKETS[-1]` tokens (any mix of prefill and decode) from
    the graphs of its token bucket, captured on first use."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        scratch_slot: int,
        impl: AttentionImpl,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.scratch_slot = scratch_slot  # a slot of the scratch block: padding rows' K/V
        self.impl = impl
        config = model.config
        device, dtype = kv_caches[0].device, kv_caches[0].dtype
        most = TOKEN_BUCKETS[-1]
        self.ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(most, dtype=torch.long, device=device)
        self.slots = torch.full((most,), scratch_slot, dtype=torch.long, device=device)
        heads = (most, config.num_heads_per_rank, config.head_dim)
        self.q_in = torch.zeros(heads, dtype=dtype, device=device)
        self.out = torch.zeros(heads, dtype=dtype, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[int, _Pieces] = {}

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= TOKEN_BUCKETS[-1]

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention
    ) -> torch.Tensor:
        """The model's hidden states [T, hidden] for the step's ids and positions [T] (`fits`);
        `attn` holds the step's metadata and its per-layer swap-in waits."""
        num_tokens = ids.shape[0]
        bucket = next(b for b in TOKEN_BUCKETS if b >= num_tokens)
        pieces = self.captured.get(bucket) or self._capture(bucket)
        self.ids[:num_tokens].copy_(ids)
        self.positions[:num_tokens].copy_(positions)
        self.slots[:num_tokens].copy_(attn.meta.slot_mapping)
        if num_tokens < bucket:  # a larger step may have left real slots there
            self.slots[num_tokens:bucket].fill_(self.scratch_slot)
        q, out = self.q_in[:num_tokens], self.out[:num_tokens]
        for layer, graph in enumerate(pieces.graphs[:-1]):
            if attn.before_layer is not None:  # the graph writes this layer's K/V
                attn.before_layer(layer)
            graph.replay()
            attn.attend(layer, q, out)
        pieces.graphs[-1].replay()
        return pieces.hidden[:num_tokens]

    def capture_all(self, max_tokens: int = TOKEN_BUCKETS[-1]) -> int:
        """Capture every bucket a step of up to `max_tokens` can use, largest first (a warm-up,
        so no capture lands inside a measured step); returns how many buckets there are."""
        buckets = [b for b in TOKEN_BUCKETS if b < max_tokens]
        buckets.append(next((b for b in TOKEN_BUCKETS if b >= max_tokens), TOKEN_BUCKETS[-1]))
        for bucket in reversed(buckets):
            if bucket not in self.captured:
                self._capture(bucket)
        return len(buckets)

    def _capture(self, bucket: int) -> _Pieces:
        ids, positions = self.ids[:bucket], self.positions[:bucket]
        # the warm-up writes K/V: into the scratch block only, whatever a step left here
        self.slots[:bucket].fill_(self.scratch_slot)
        cut = _Cut(
            self.kv_caches, self.slots[:bucket], self.q_in[:bucket], self.out[:bucket], self.impl
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graphs = [torch.cuda.CUDAGraph()]

        def next_graph() -> None:
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self.pool, capture_error_mode=CAPTURE_MODE)

        with torch.cuda.stream(side):
            # outside any capture first: cuBLAS and Triton pick and load their kernels, the
            # rotary tables reach the device
            self.model(ids, positions, cut)
            torch.cuda.synchronize()
            cut.cut, cut.num_cuts = next_graph, 0
            graphs[0].capture_begin(pool=self.pool, capture_error_mode=CAPTURE_MODE)
            try:
                hidden = self.model(ids, positions, cut)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is broken already
                    graphs[-1].capture_end()
                raise
            graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(side)
        num_layers = self.model.config.num_layers
        if cut.num_cuts != num_layers:
            raise RuntimeError(
                f"{cut.num_cuts} attention calls in a forward of {num_layers} "
                "layers: the model cannot be captured in pieces"
            )
        self.captured[bucket] = _Pieces(graphs, hidden)
        return self.captured[bucket]
