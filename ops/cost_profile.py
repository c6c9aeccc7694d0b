"""`pensieve profile`: measure what recomputing one KV chunk costs on this device.

For each context length l = 2^k (from the chunk size up to `max_context`) it times the attention
of chunks of query tokens over l cached positions, through every layer, on the path the engine
uses (`PagedAttention`: write the chunks' K/V into the paged cache, then attend). The non-attention
cost is a forward of fresh chunks with the attention left out. The table it
writes is what `CostModel.from_json` loads (format: actors/scheduler/kv/cost_model.py).

Chunks are measured in batches and each time is divided by the batch size: recompute runs inside
a batched step, and a lone chunk on a GPU measures kernel-launch overhead and weight reads, which
would flatten Cost(l) and turn the eviction policy into LRU. Attention batches shrink at long
contexts so their K/V fit in `max_kv_tokens` positions per layer.

Timing: CUDA events on CUDA, `time.perf_counter` elsewhere; warm-up runs, then the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pensieve.actors.scheduler.kv.cost_model import (
    PROFILE_FORMAT,
    CostModel,
    context_lens_to_profile,
)
from pensieve.kernels import build_metadata
from pensieve.kernels.fused import rope_write_kv
from pensieve.models.attention import PagedAttention, allocate_kv_caches
from pensieve.models.config import ModelConfig
from pensieve.models.loader import CausalLM, load_model
from pensieve.ops.cli_options import HelpFormatter

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ProfileSettings:
    chunk_size: int = 32
    max_context: int | None = None  # None: the model's longest context
    batch_chunks: int = 16  # chunks measured together; times are per chunk
    max_kv_tokens: int = 1 << 16  # cached positions per layer an attention batch may use
    warmup: int = 3
    repeats: int = 10

    def __post_init__(self) -> None:
        if min(self.chunk_size, self.batch_chunks, self.repeats) < 1 or self.warmup < 0:
            raise ValueError("need chunk_size, batch_chunks, repeats >= 1 and warmup >= 0")
        if self.max_kv_tokens < self.chunk_size:
            raise ValueError("max_kv_tokens must hold at least one chunk")

    def chunks_at(self, context_len: int) -> int:
        return max(1, min(self.batch_chunks, self.max_kv_tokens // context_len))


@dataclass(frozen=True)
class _Target:
    """What is being profiled, and where."""

    model: CausalLM
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    generator: torch.Generator


def profile_model(
    model: CausalLM,
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    settings: ProfileSettings | None = None,
) -> dict[str, Any]:
    """Measure the chunk recompute cost table of `model` (already on `device` in `dtype`).

    Returns the JSON-ready table (seconds per chunk) that `CostModel.from_profile` reads.
    """
    s = settings or ProfileSettings()
    device = torch.device(device)
    target = _Target(model, config, device, dtype, torch.Generator(device).manual_seed(0))
    timer = _Timer(device, s.warmup, s.repeats)
    contexts = context_lens_to_profile(s.chunk_size, s.max_context or config.max_context_len)
    with torch.inference_mode():
        attention = {n: _time_attention(target, s, n, timer) for n in contexts}
        non_attention = _time_non_attention(target, s, timer)
    return {
        "format": PROFILE_FORMAT,
        "chunk_size": s.chunk_size,
        "non_attention_s": non_attention,
        "attention_s": {str(n): seconds for n, seconds in attention.items()},
        "source": (
            f"profile of {config.name} on {_device_name(device)} in {dtype}, "
            f"batches of up to {s.batch_chunks} chunks"
        ),
    }


class _Timer:
    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device = device
        self.warmup = warmup
        self.repeats = repeats

    def median_s(self, fn: Callable[[], object]) -> float:
        """Median wall time of `fn()` in seconds, after `warmup` untimed runs."""
        for _ in range(self.warmup):
            fn()
        return statistics.median(self._once(fn) for _ in range(self.repeats))

    def _once(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def _time_attention(t: _Target, s: ProfileSettings, context_len: int, timer: _Timer) -> float:
    """Seconds per chunk for chunks of queries to attend to `context_len` positions, all layers.

    Each chunk is the last one of its own sequence, with blocks of its own.
    """
    num_chunks = s.chunks_at(context_len)
    blocks_per_seq = -(-context_len // s.chunk_size)
    caches = allocate_kv_caches(
        t.config, num_chunks * blocks_per_seq, s.chunk_size, t.dtype, t.device
    )
    for cache in caches:
        cache.normal_(generator=t.generator)  # realistic values; zeros could take a fast path
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_chunks)]
    meta = build_metadata(
        [s.chunk_size] * num_chunks, [context_len] * num_chunks, tables, s.chunk_size, t.device
    )
    attn = PagedAttention(caches, meta, t.config.attn_scale)
    num_tokens = num_chunks * s.chunk_size
    q = _randn(t, (num_tokens, t.config.num_heads, t.config.head_dim))
    k = _randn(t, (num_tokens, t.config.num_kv_heads, t.config.head_dim))
    v = _randn(t, (num_tokens, t.config.num_kv_heads, t.config.head_dim))

    def all_layers() -> None:
        for layer_idx in range(t.config.num_layers):
            attn(layer_idx, q, k, v)

    return timer.median_s(all_layers) / num_chunks


class _NoAttention:
    """An attention backend that leaves attention itself out: the layer's shapes, without it.

    A model whose RoPE is fused with the K/V write (kernels/fused.py) gets that kernel run into a
    scratch cache, since RoPE is per-token work; so its non-attention time includes the K/V write,
    which the attention timing counts as well (a few microseconds a layer, twice)."""

    def __init__(self, t: _Target, num_tokens: int, block_size: int) -> None:
        self.cache = allocate_kv_caches(
            t.config, -(-num_tokens // block_size), block_size, t.dtype, t.device
        )[0]
        self.slots = torch.arange(num_tokens, device=t.device)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return q  # [T, Hq, D]

    def attend_qkv(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        num_q_heads: int,
    ) -> torch.Tensor:
        return rope_write_kv(qkv, cos, signed_sin, self.cache, self.slots, num_q_heads)


def _time_non_attention(t: _Target, s: ProfileSettings, timer: _Timer) -> float:
    """Seconds per chunk of a forward (no logits) with the attention left out.

    Timed directly rather than as (forward - attention): on a small model the difference of two
    noisy timings can come out at or below zero.
    """
    num_chunks, size = s.batch_chunks, s.chunk_size
    num_tokens = num_chunks * size
    attn = _NoAttention(t, num_tokens, size)
    input_ids = torch.randint(
        t.config.vocab_size, (num_tokens,), generator=t.generator, device=t.device
    )  # [N]
    positions = torch.arange(size, device=t.device).repeat(num_chunks)  # [N]
    return timer.median_s(lambda: t.model.forward(input_ids, positions, attn)) / num_chunks


def _randn(t: _Target, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=t.generator, device=t.device).to(t.dtype)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pensieve profile",
        description="Measure what recomputing a 32-token KV chunk costs on this device, by the "
        "context it attends to; `pensieve serve --profile COST.json` makes eviction rank by it.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="a Hugging Face folder, a .gguf file, smollm2 or preset:NAME",
    )
    parser.add_argument(
        "--out", required=True, type=Path, metavar="COST.json", help="where to write the JSON table"
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument(
        "--device", default=default_device, choices=["cpu", "cuda"], help="where to measure"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="of the weights and the KV cache (default: bfloat16 on CUDA, else float32)",
    )
    parser.add_argument(
        "--max-context",
        type=int,
        metavar="N",
        help="longest context measured (default: the model's longest)",
    )
    defaults = ProfileSettings()
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=defaults.chunk_size,
        metavar="N",
        help="tokens per chunk: the engine's block size",
    )
    parser.add_argument(
        "--batch-chunks",
        type=int,
        default=defaults.batch_chunks,
        metavar="N",
        help="chunks measured together; times are per chunk",
    )
    parser.add_argument(
        "--max-kv-tokens",
        type=int,
        default=defaults.max_kv_tokens,
        metavar="N",
        help="cached positions per layer one measured batch may use",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=defaults.warmup,
        metavar="N",
        help="untimed runs before each measurement",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        metavar="N",
        help="timed runs per measurement (the median is kept)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    loaded = load_model(args.model, device, dtype)
    settings = ProfileSettings(
        chunk_size=args.chunk_size,
        max_context=args.max_context,
        batch_chunks=args.batch_chunks,
        max_kv_tokens=args.max_kv_tokens,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    table = profile_model(loaded.model, loaded.config, device, dtype, settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    _print_summary(CostModel.from_profile(table), args.out)
    return 0


def _print_summary(model: CostModel, out: Path) -> None:
    print(f"{model.source}; non-attention {model.non_attention_s * 1e3:.3f} ms per chunk")
    print(f"{'context':>8} {'attention ms':>13} {'cost ms':>9}")
    for context_len, attention_s in zip(model.context_lens, model.attention_s, strict=True):
        cost_ms = (attention_s + model.non_attention_s) * 1e3
        print(f"{context_len:>8} {attention_s * 1e3:>13.3f} {cost_ms:>9.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
