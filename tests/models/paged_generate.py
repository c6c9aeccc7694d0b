"""A small greedy generation loop over the paged KV cache, for tests.

It drives a model the way the engine does: every step is one flat batch that mixes sequences,
prefills go in chunks, decodes one token at a time, and blocks come from a shuffled pool so no
sequence's blocks are contiguous or in order. Attention is the torch reference through
PagedAttention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pensieve.kernels import AttentionImpl, build_metadata
from pensieve.models import CausalLM, PagedAttention, allocate_kv_caches


@dataclass
class _Seq:
    tokens: list[int]
    max_len: int  # prompt + new tokens
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    done: bool = False


class PagedRunner:
    """Owns the KV caches and a shuffled free list of block ids."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.caches = allocate_kv_caches(
            model.config, num_blocks, block_size, param.dtype, param.device
        )
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = order.tolist()

    @torch.inference_mode()
    def step(self, seqs: list[_Seq], query_lens: list[int]) -> torch.Tensor:
        """Compute `query_lens[i]` new tokens of each sequence; returns logits [T, vocab]."""
        ids: list[int] = []
        positions: list[int] = []
        for seq, qlen in zip(seqs, query_lens, strict=True):
            end = seq.num_computed + qlen
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            ids += seq.tokens[seq.num_computed : end]
            positions += range(seq.num_computed, end)
        meta = build_metadata(
            query_lens,
            [s.num_computed + q for s, q in zip(seqs, query_lens, strict=True)],
            [s.blocks for s in seqs],
            self.block_size,
        )
        attn = PagedAttention(self.caches, meta, self.model.config.attn_scale, AttentionImpl.TORCH)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), attn)  # [T, hidden]
        for seq, qlen in zip(seqs, query_lens, strict=True):
            seq.num_computed += qlen
        return self.model.compute_logits(hidden)  # [T, vocab]


def prompt_logits(model: CausalLM, prompt: list[int], block_size: int = 8) -> torch.Tensor:
    """Logits [len(prompt), vocab] of one sequence prefilled in a single step."""
    runner = PagedRunner(model, -(-len(prompt) // block_size), block_size)
    return runner.step([_Seq(list(prompt), len(prompt))], [len(prompt)])


def greedy_generate(
    model: CausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 4,
    prefill_chunk: int = 7,
    eos_token_ids: tuple[int, ...] = (),
    seed: int = 0,
) -> list[list[int]]:
    """Greedy continuations of all prompts, run together; each stops at an EOS token."""
    seqs = [_Seq(list(p), len(p) + max_new_tokens) for p in prompts]
    num_blocks = sum(-(-s.max_len // block_size) for s in seqs) + 3
    runner = PagedRunner(model, num_blocks, block_size, seed)
    while active := [s for s in seqs if not s.done]:
        query_lens = [min(prefill_chunk, len(s.tokens) - s.num_computed) for s in active]
        logits = runner.step(active, query_lens)
        last_rows = torch.tensor(query_lens).cumsum(0) - 1
        for seq, row in zip(active, last_rows.tolist(), strict=True):
            if seq.num_computed < len(seq.tokens):
                continue  # still prefilling: no token to sample yet
            token = int(logits[row].argmax())
            seq.tokens.append(token)
            seq.done = len(seq.tokens) >= seq.max_len or token in eos_token_ids
    return [s.tokens[len(p) :] for s, p in zip(seqs, prompts, strict=True)]
