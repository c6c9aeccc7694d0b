"""Token sampling: greedy rows in one argmax, others with temperature, top-k and top-p.

A seeded request draws from its own generator keyed by (seed, output index), so its tokens do not
depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pensieve.actors.wire.step import SamplingParams


def sample_async(
    logits: torch.Tensor, params: Sequence[SamplingParams], sample_indices: Sequence[int]
) -> torch.Tensor:  # logits: [N, V] float32
    """The sampled tokens [N] on the logits' device. When every row is greedy nothing waits for
    the device, so the caller can do host work before reading them (`.tolist()`)."""
    tokens = torch.argmax(logits, dim=-1)  # [N]
    for row, (p, index) in enumerate(zip(params, sample_indices, strict=True)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, index)
    return tokens


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask the logits of the rows `rows` [R] to the tokens `bitmask` [R, W] int32 allows (bit j
    of word i: token 32 * i + j; tokens past 32 * W are refused) with -inf, in place; every
    other row is left as it is. All three on one device."""  # logits: [N, V]
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [R, W * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    masked = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))  # [R, V]
    logits.index_copy_(0, rows, masked)


def _sample_row(logits: torch.Tensor, p: SamplingParams, index: int) -> int:  # logits: [V]
    # Shifted so the largest logit is 0 before dividing: however small the temperature (the API
    # accepts any positive one), every value stays finite or becomes -inf, never +inf or NaN.
    # A temperature below float32's smallest normal would round to 0 in the division; at that
    # scale the distribution is already the greedy one.
    logits = logits.float()
    temperature = max(p.temperature, torch.finfo(torch.float32).tiny)
    scaled = (logits - logits.max()) / temperature
    if p.top_k is not None and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        outside = before >= p.top_p
        outside[0] = False  # the likeliest token always stays (top_p may round to 0 in float32)
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = torch.Generator(device="cpu")
    if p.seed is None:
        generator.seed()
    else:
        generator.manual_seed((p.seed * 1_000_003 + index) % (2**63))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
