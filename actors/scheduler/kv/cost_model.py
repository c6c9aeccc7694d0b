"""What it costs to rebuild one KV chunk: the numerator of Pensieve's retention value.

A chunk that attends to `l` tokens of context (itself included) costs
    Cost(l) = Cost_attn(l) + c
seconds to recompute, where `c` (projections, MLP, norms) does not depend on `l`. The scheduler
keeps the chunks of highest retention value V = Cost(l) / T, T being how long the conversation has
been idle, and evicts the lowest first.

`Cost_attn` comes from a profile (`pensieve profile`, ops/cost_profile.py) measured at powers of two
and interpolated piecewise-linearly, or from FLOP and byte counts (`CostModel.analytic`). Both give
the same JSON table:

    {"format": "pensieve.cost_profile/1", "chunk_size": 32, "non_attention_s": 1.1e-4,
     "attention_s": {"32": 2.0e-5, "64": 2.1e-5, ...}, "source": "free text"}
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "pensieve.cost_profile/1"
# Rough dense bf16 matmul rate and HBM bandwidth of an H100; pass the real device's figures.
DEFAULT_FLOPS_PER_S = 400e12
DEFAULT_BYTES_PER_S = 2.0e12
ANALYTIC_MAX_CONTEXT = 1 << 17


@dataclass(frozen=True)
class CostModel:
    """Seconds to recompute one chunk of `chunk_size` tokens, by context length.

    Invariants: at least one point; `context_lens` strictly increasing and >= 1; `attention_s`
    non-negative and non-decreasing, so `cost` never decreases as the context grows. Below the
    first point the cost is clamped to it; beyond the last it grows along the last segment (in
    proportion to `l` when there is only one point).
    """

    context_lens: tuple[int, ...]
    attention_s: tuple[float, ...]
    non_attention_s: float
    chunk_size: int
    source: str = ""

    def __post_init__(self) -> None:
        if not self.context_lens or len(self.context_lens) != len(self.attention_s):
            raise ValueError("a cost model needs one attention time per context length (>= 1)")
        if self.context_lens[0] < 1 or _decreases(self.context_lens, strict=True):
            raise ValueError(f"context lengths must be >= 1 and increasing: {self.context_lens}")
        if self.attention_s[0] < 0 or _decreases(self.attention_s, strict=False):
            raise ValueError("attention times must be >= 0 and non-decreasing")
        if self.non_attention_s < 0 or self.chunk_size < 1:
            raise ValueError("non_attention_s must be >= 0 and chunk_size >= 1")

    def cost(self, context_len: int) -> float:
        """Seconds to recompute one chunk that attends to `context_len` tokens."""
        return self.attention_cost(context_len) + self.non_attention_s

    def attention_cost(self, context_len: int) -> float:
        lens, secs = self.context_lens, self.attention_s
        if context_len <= lens[0]:
            return secs[0]
        i = bisect.bisect_left(lens, context_len)
        if i == len(lens):
            if len(lens) == 1:
                return secs[0] * context_len / lens[0]
            i -= 1  # extrapolate along the last segment
        slope = (secs[i] - secs[i - 1]) / (lens[i] - lens[i - 1])
        return secs[i - 1] + slope * (context_len - lens[i - 1])

    def retention_value(self, context_len: int, idle_s: float) -> float:
        """V = Cost(l) / T; infinite for a conversation that is active right now (T <= 0)."""
        if idle_s <= 0:
            return math.inf
        return self.cost(context_len) / idle_s

    # --- the JSON table ---------------------------------------------------------------------

    @classmethod
    def from_profile(cls, table: Mapping[str, Any]) -> CostModel:
        """Build from a profile table (module doc). Measured attention times are made monotone
        (running maximum): timing noise at short contexts must not make a longer context look
        cheaper."""
        if table.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a cost profile: format is {table.get('format')!r}")
        points = sorted((int(n), float(t)) for n, t in dict(table["attention_s"]).items())
        monotone: list[float] = []
        for _, seconds in points:
            monotone.append(max(seconds, monotone[-1]) if monotone else seconds)
        return cls(
            context_lens=tuple(n for n, _ in points),
            attention_s=tuple(monotone),
            non_attention_s=float(table["non_attention_s"]),
            chunk_size=int(table["chunk_size"]),
            source=str(table.get("source", "")),
        )

    def to_profile(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "chunk_size": self.chunk_size,
            "non_attention_s": self.non_attention_s,
            "attention_s": dict(zip(map(str, self.context_lens), self.attention_s, strict=True)),
            "source": self.source,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_profile(), indent=2)

    @classmethod
    def from_json(cls, path: Path | str) -> CostModel:
        """Load a table written by `pensieve profile` (or `to_json`)."""
        try:
            return cls.from_profile(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: cannot load the cost profile: {exc}") from exc

    # --- analytic fallback ------------------------------------------------------------------

    @classmethod
    def analytic(
        cls,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        chunk_size: int = 32,
        flops_per_s: float = DEFAULT_FLOPS_PER_S,
        bytes_per_s: float = DEFAULT_BYTES_PER_S,
        dtype_bytes: int = 2,
        gated_mlp: bool = True,
    ) -> CostModel:
        """Estimate from the model's shape and the device's peak rates (no measurement).

        Per layer, a chunk of C tokens at context l costs 4·C·l·Hq·D attention FLOPs and reads
        2·l·Hkv·D K/V elements; attention time is the larger of the compute and memory times, so
        it is linear in l and the table is exact under interpolation. The projections and the MLP
        cost 2·C·hidden·((Hq + 2·Hkv)·D + Hq·D) + (3 if gated else 2)·2·C·hidden·ffn FLOPs,
        whatever l is. Weight reads are left out: in a batched step they are shared by many
        chunks.
        """
        c = chunk_size
        proj_flops = 2 * c * hidden_size * ((num_heads + 2 * num_kv_heads) * head_dim)
        proj_flops += 2 * c * num_heads * head_dim * hidden_size
        mlp_flops = (3 if gated_mlp else 2) * 2 * c * hidden_size * intermediate_size

        def attention_s(context_len: int) -> float:
            compute = 4 * c * context_len * num_heads * head_dim / flops_per_s
            memory = 2 * context_len * num_kv_heads * head_dim * dtype_bytes / bytes_per_s
            return num_layers * max(compute, memory)

        lens = _powers_of_two(chunk_size, ANALYTIC_MAX_CONTEXT)
        return cls(
            context_lens=lens,
            attention_s=tuple(attention_s(n) for n in lens),
            non_attention_s=num_layers * (proj_flops + mlp_flops) / flops_per_s,
            chunk_size=chunk_size,
            source=f"analytic: {flops_per_s:.3g} FLOP/s, {bytes_per_s:.3g} B/s",
        )


def context_lens_to_profile(chunk_size: int, max_context: int) -> tuple[int, ...]:
    """Powers of two from the first one that holds a whole chunk up to `max_context`."""
    return _powers_of_two(chunk_size, max_context)


def _powers_of_two(at_least: int, at_most: int) -> tuple[int, ...]:
    first = 1 << max(at_least - 1, 0).bit_length()
    if first > at_most:
        raise ValueError(f"no power of two between {at_least} and {at_most}")
    return tuple(1 << k for k in range(first.bit_length() - 1, at_most.bit_length()))


def _decreases(values: tuple[int, ...] | tuple[float, ...], strict: bool) -> bool:
    pairs = zip(values, values[1:], strict=False)
    return any(b <= a if strict else b < a for a, b in pairs)
