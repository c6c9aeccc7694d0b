"""The executor core: runs one step of the model on the paged KV cache and samples.

Per step it issues the step's swaps, builds the attention metadata once (every layer reuses it),
runs the flat batch of query tokens through the model, and samples the pieces that end a request.
"""

from __future__ import annotations

import torch

from pensieve.actors.config import CacheConfig
from pensieve.actors.cuda_graphs import DecodeGraphs
from pensieve.actors.sampler import sample_async
from pensieve.actors.step import StepPlan
from pensieve.actors.swap import SwapEngine
from pensieve.kernels import AttentionImpl, build_metadata
from pensieve.models.attention import PagedAttention, allocate_kv_caches
from pensieve.models.loader import CausalLM


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        impl: AttentionImpl = AttentionImpl.AUTO,
        cuda_graphs: bool = True,
        swap_out_dma: bool = False,
    ) -> None:
        self.model = model
        self.config = model.config
        self.cache = cache
        self.device = device
        self.impl = impl
        # one block more than the manager hands out: the scratch block of padded graph rows
        self.gpu_caches = allocate_kv_caches(
            self.config, cache.num_gpu_blocks + 1, cache.block_size, dtype, device
        )
        num_cpu = cache.num_cpu_blocks if cache.uses_cpu_tier else 0
        pin = device.type == "cuda"
        self.cpu_caches = [
            torch.empty((num_cpu, *c.shape[1:]), dtype=dtype, pin_memory=pin)
            for c in self.gpu_caches
        ]
        self.swap = SwapEngine(self.gpu_caches, self.cpu_caches, out_dma=swap_out_dma)
        self.scale = self.config.attn_scale
        self.graphs = (
            DecodeGraphs(
                model,
                self.gpu_caches,
                cache.num_gpu_blocks,
                cache.block_size,
                self.config.max_context_len,
                self.scale,
                impl,
            )  # fmt: skip
            if cuda_graphs and device.type == "cuda"
            else None
        )

    def execute(self, plan: StepPlan) -> list[int]:
        """Run the plan; returns one sampled token per piece that samples, in plan order."""
        return self.launch(plan).tolist()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> torch.Tensor:
        """Issue the plan's copies and forward; returns its sampled tokens [pieces that sample]
        on the device, in plan order. With greedy sampling the step may still be running: the
        host can work until it reads them."""
        self.swap.issue(plan.orders, defer_out=True)
        sampling = [p for p in plan.pieces if p.sampling is not None]
        if not plan.pieces:
            self.swap.issue_out()
            return torch.empty(0, dtype=torch.long)
        logits = self.logits(plan)
        params = [p.sampling for p in sampling]
        tokens = sample_async(logits, params, [p.sample_index for p in sampling])  # type: ignore[arg-type]
        self.swap.issue_out()  # while the device runs the forward
        return tokens

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits [pieces that sample, vocab] of the plan's forward (swaps already issued), rows
        in plan order."""
        if self.graphs is not None and self.graphs.fits(plan):
            self.swap.wait_all()
            return self.graphs.logits(plan)
        # single-token pieces (decodes) first: attention then runs them on decode tiles
        order = sorted(
            range(len(plan.pieces)), key=lambda i: plan.pieces[i].end - plan.pieces[i].start > 1
        )
        pieces = [plan.pieces[i] for i in order]
        token_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # plan index of a sampling piece -> its last token's row
        for i, piece in zip(order, pieces, strict=True):
            token_ids += piece.token_ids
            positions += range(piece.start, piece.end)
            if piece.sampling is not None:
                last_row[i] = len(token_ids) - 1
        meta = build_metadata(
            [p.end - p.start for p in pieces],
            [p.end for p in pieces],
            [p.block_table for p in pieces],
            self.cache.block_size,
            self.device,
        )
        attn = PagedAttention(
            self.gpu_caches,
            meta,
            self.scale,
            impl=self.impl,
            before_layer=self.swap.wait_layer if self.swap.pipelined else None,
        )
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        hidden = self.model(ids, pos, attn)  # [T, hidden]
        # from pinned memory: a plain copy would make the host wait for the whole forward
        rows = torch.tensor([last_row[i] for i in sorted(last_row)])
        if self.device.type == "cuda":
            rows = rows.pin_memory()
        return self.model.compute_logits(hidden[rows.to(self.device, non_blocking=True)])
