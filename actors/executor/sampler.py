"""Token sampling: greedy rows in one argmax, the others together with temperature, min-p,
top-k and top-p, on the logits' device and without waiting for it.

A sampled row draws one uniform number on the host, from its own generator keyed by (seed,
output index) if the request is seeded, and takes the token where that number falls in the
cumulative distribution: its tokens do not depend on which other requests share the batch, and
the draw needs nothing back from the device (the step that made the logits may still be
running when this returns).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from pensieve.actors.wire.step import SamplingParams

_TINY = torch.finfo(torch.float32).tiny  # the smallest temperature divided by
_UNSEEDED = random.Random()  # the draws of unseeded rows (seeded from the system's entropy)
_MASK64 = (1 << 64) - 1


def sample_async(
    logits: torch.Tensor, params: Sequence[SamplingParams], sample_indices: Sequence[int]
) -> torch.Tensor:  # logits: [N, V] float32
    """The sampled tokens [N] on the logits' device; nothing waits for the device, so the
    caller can do host work before reading them (`.tolist()`)."""
    tokens = torch.argmax(logits, dim=-1)  # [N]
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if rows:
        chosen = [params[row] for row in rows]
        vocab = logits.shape[1]
        # per row: temperature, top_p (none: above any mass), top_k (none: the vocabulary),
        # the draw in [0, 1), log(min_p) (none: -inf; the likeliest token's scaled logit is 0)
        settings = torch.tensor(
            [
                (
                    p.temperature,
                    p.top_p if p.top_p < 1.0 else float("inf"),
                    vocab if p.top_k is None else p.top_k,
                    _draw(p, sample_indices[row]),
                    math.log(p.min_p) if p.min_p > 0.0 else float("-inf"),
                )
                for row, p in zip(rows, chosen, strict=True)
            ],
            dtype=torch.float64,
        )
        where = torch.tensor(rows, dtype=torch.long)
        if logits.is_cuda:  # copied behind the step, with no wait for it
            settings, where = settings.pin_memory(), where.pin_memory()
        on_device = settings.to(logits.device, non_blocking=True)
        where = where.to(logits.device, non_blocking=True)
        picked = _sample_rows(logits.index_select(0, where), on_device, chosen)
        tokens.index_copy_(0, where, picked)
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


def _draw(p: SamplingParams, index: int) -> float:
    """A uniform draw in [0, 1): of the row's own stream, keyed by (seed, output index), if the
    request is seeded (SplitMix64: a hash of the key, a fraction of a microsecond where making a
    generator per row took over ten)."""
    if p.seed is None:
        return _UNSEEDED.random()
    z = ((p.seed * 1_000_003 + index) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def _sample_rows(
    logits: torch.Tensor, settings: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:  # logits: [R, V]; settings: [R, 5] (see `sample_async`)
    # Shifted so each row's largest logit is 0 before dividing: however small the temperature
    # (the API accepts any positive one), every value stays finite or becomes -inf, never +inf
    # or NaN. A temperature below float32's smallest normal is taken as that smallest normal;
    # at that scale the distribution is already the greedy one.
    logits = logits.float()
    temperature = settings[:, 0:1].float().clamp_min(_TINY)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    vocab = scaled.shape[1]
    if any(p.min_p > 0.0 for p in params):  # less likely than min_p times the likeliest
        scaled = scaled.masked_fill(scaled < settings[:, 4:5], float("-inf"))
    truncated = any(p.top_p < 1.0 or (p.top_k is not None and p.top_k < vocab) for p in params)
    order = None
    if truncated:  # the likeliest first: top-k and top-p cut the tail
        if all(p.top_k is not None and p.top_k < vocab for p in params):
            # only the largest top-k of the rows can be kept: no need to sort the rest
            largest = max(p.top_k or vocab for p in params)
            scaled, order = torch.topk(scaled, largest, dim=-1, sorted=True)
        else:
            scaled, order = torch.sort(scaled, dim=-1, descending=True)
        rank = torch.arange(scaled.shape[1], device=scaled.device)
        scaled = scaled.masked_fill(rank >= settings[:, 2:3], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if truncated:
        before = torch.cumsum(probs, dim=-1) - probs  # the mass of the tokens likelier
        outside = before >= settings[:, 1:2].float()
        outside[:, 0] = False  # the likeliest token always stays (top_p may round to 0)
        probs = probs.masked_fill(outside, 0.0)
    # the first token whose cumulative mass passes the draw (in float64, so that a draw below
    # 1 stays below the total and a token of no mass is never taken)
    cumulative = torch.cumsum(probs.double(), dim=-1)
    target = settings[:, 3:4] * cumulative[:, -1:]
    picked = torch.searchsorted(cumulative, target, right=True).clamp_max(probs.shape[1] - 1)
    if order is not None:
        picked = order.gather(1, picked)
    return picked.squeeze(1)
