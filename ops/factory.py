"""Build a ready engine from user-facing options: model, tokenizer, cache tiers, cost model."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pensieve.actors.config import DEFAULTS, CacheConfig, Policy, SchedulerConfig
from pensieve.actors.executor.disk_cache import DiskCache
from pensieve.actors.executor.disk_views import chunk_geometry
from pensieve.actors.executor.grammar import GrammarMasks
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.kv.cost_model import CostModel
from pensieve.actors.scheduler.remote_runner import RemoteRunner
from pensieve.actors.scheduler.step_budget import StepTimeModel
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.chunk_keys import PublicKeys
from pensieve.actors.wire.step import StepRunner
from pensieve.models.config import ModelConfig
from pensieve.models.loader import LoadedModel, ModelLoadError, load_model
from pensieve.models.shard_loader import load_shard
from pensieve.models.tensor_parallel import TensorShard
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.public_prompts import public_keys
from pensieve.store.disk import DiskConfig, DiskTier, DiskTierError

logger = logging.getLogger("pensieve")

GIB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Built:
    engine: Engine
    loaded: LoadedModel
    chat: ChatTokenizer
    options: EngineOptions


def build(options: EngineOptions) -> Built:
    """Load the model and its tokenizer, then assemble an engine around them; logs each phase."""
    loaded = load_weights(options)
    begin = time.perf_counter()
    chat = _chat(options, loaded)
    logger.info("tokenizer ready in %.1f s", time.perf_counter() - begin)
    begin = time.perf_counter()
    built = assemble(options, loaded, chat)
    cache = built.engine.cache_config
    logger.info(
        "engine ready in %.1f s: policy %s, GPU tier %d tokens, CPU tier %d tokens, "
        "context %d tokens",
        time.perf_counter() - begin,
        cache.policy.value,
        cache.num_gpu_blocks * cache.block_size,
        cache.num_cpu_blocks * cache.block_size,
        built.engine.max_model_len,
    )
    return built


def build_runner(options: EngineOptions) -> ModelRunner:
    """What an executor process holds, and nothing else: the model on its device, the KV tiers
    and their swap engine (`ModelRunner`); no scheduler, cache manager or tokenizer."""
    loaded = load_weights(options)
    begin = time.perf_counter()
    runner = model_runner(options, loaded)
    chat = _chat(options, loaded)
    runner.grammars = grammar_masks(chat, loaded.config.vocab_size, options.device)
    cache = runner.cache
    logger.info(
        "model runner ready in %.1f s: GPU tier %d tokens, CPU tier %d tokens",
        time.perf_counter() - begin,
        cache.num_gpu_blocks * cache.block_size,
        cache.num_cpu_blocks * cache.block_size,
    )
    return runner


def load_weights(options: EngineOptions) -> LoadedModel:
    """The model of `options` on its device, in its dtype; logs what was loaded."""
    if options.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {options.dtype!r}; choose from {', '.join(DTYPES)}")
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA GPU is available")
    dtype = DTYPES[options.dtype]
    begin = time.perf_counter()
    loaded = load_model(options.model, device, dtype, seed=options.seed)
    config = loaded.config
    num_params = sum(p.numel() for p in loaded.model.parameters())
    logger.info(
        "model %s loaded in %.1f s: %s, %d layers, %.0fM parameters, %s on %s",
        options.model,
        time.perf_counter() - begin,
        config.arch.value,
        config.num_layers,
        num_params / 1e6,
        options.dtype,
        device,
    )
    return loaded


def cpu_threads(options: EngineOptions) -> int | None:
    """PyTorch threads for the thread that steps a CPU engine (None on a GPU: torch's default).

    One core is left to everything else in the process (the event loop, the tokenizer, the
    store writer, a nats-server beside it): PyTorch's parallel regions wait for their slowest
    thread, so a core shared with them slows every step (on 2 cores, 1 thread served ~1.5x the
    tokens per second of 2)."""
    if options.device != "cpu":
        return None
    if options.cpu_threads is not None:
        return options.cpu_threads
    return max(1, (os.cpu_count() or 1) - 1)


def assemble(options: EngineOptions, loaded: LoadedModel, chat: ChatTokenizer) -> Built:
    """A fresh engine (empty caches) around an already loaded model."""
    runner = model_runner(options, loaded)
    runner.grammars = grammar_masks(chat, loaded.config.vocab_size, options.device)
    return _around(runner, runner.cache, options, loaded, chat)


def grammar_masks(chat: ChatTokenizer, vocab_size: int, device: str) -> GrammarMasks:
    """What samples constrained requests, over the chat tokenizer's vocabulary. On a GPU its
    tokenizer is made now, beside the start-up; on the CPU (tests, replays) when first used."""
    masks = GrammarMasks.from_hf(chat.tokenizer, chat.eos_token_ids, vocab_size)
    if device != "cpu":
        masks.warm()
    return masks


def model_runner(options: EngineOptions, loaded: LoadedModel) -> ModelRunner:
    """A model runner (empty KV tiers, sized as `options` say) around an already loaded model,
    with the disk tier below them if `options` give one (what a run before left there kept)."""
    device = next(loaded.model.parameters()).device
    dtype = DTYPES[options.dtype]
    cache = cache_config(options, loaded.config, device, dtype)
    runner = ModelRunner(loaded.model, cache, device, dtype)
    if options.disk_tier and cache.uses_cpu_tier:
        runner.disk = open_disk_cache(options, runner, rank=0)
    capture_graphs(runner, options)
    return runner


def capture_graphs(runner: ModelRunner, options: EngineOptions) -> None:
    """Every CUDA graph the runner can use, captured before serving (none on the CPU)."""
    if runner.graphs is None and runner.mixed_graphs is None:
        return
    begin = time.perf_counter()
    decodes, steps = runner.capture_graphs(options.max_num_seqs, options.max_batch_tokens)
    logger.info(
        "CUDA graphs captured in %.1f s: %d decode graphs, %d step sizes with prefill",
        time.perf_counter() - begin,
        decodes,
        steps,
    )


def open_disk_cache(options: EngineOptions, runner: ModelRunner, rank: int) -> DiskCache:
    """The disk tier of one rank, in its own folder of `--disk-cache-dir`; chunks of another
    model, dtype, shard or layout found there are not loaded (see docs/disk-tier.md)."""
    assert options.disk_cache_dir is not None and options.disk_cache_gb is not None
    path = Path(options.disk_cache_dir) / f"rank{rank}"
    path.mkdir(exist_ok=True)
    geometry = chunk_geometry(runner.cpu_caches)
    shard = "" if runner.shard is None else f"|rank={rank}/{runner.shard.world_size}"
    fingerprint = f"{model_identity(options)}|block={options.block_size}{shard}"
    budget = int(options.disk_cache_gb * GIB)
    try:
        tier = DiskTier.open(DiskConfig(path, budget), geometry, fingerprint)
    except DiskTierError as error:  # e.g. another process serves from it: one clear line
        raise ValueError(str(error)) from None
    given = options.disk_read_gbps
    rate = (DEFAULTS.disk_read_gbps if given is None else given) * 1e9
    caches = runner.gpu_caches, runner.cpu_caches
    streams = runner.swap.copy_streams
    return DiskCache(tier, *caches, rate, measure=given is None, copy_streams=streams)


def rank_runner(
    options: EngineOptions,
    shard: TensorShard,
    device: torch.device,
    agree: Callable[[CacheConfig], CacheConfig],
) -> ModelRunner:
    """One tensor-parallel rank's model runner: its share of the model on `device`, and KV
    tiers of its share of every block, as many blocks as `agree` (the smallest over the ranks,
    so one block table fits them all)."""
    dtype = DTYPES[options.dtype]
    begin = time.perf_counter()
    loaded = load_shard(options.model, device, dtype, shard, seed=options.seed)
    logger.info(
        "rank %d of %d: its share of %s loaded in %.1f s on %s",
        shard.rank,
        shard.world_size,
        options.model,
        time.perf_counter() - begin,
        device,
    )
    cache = agree(cache_config(options, loaded.config, device, dtype))
    grammars = grammar_masks(_chat(options, loaded), loaded.config.vocab_size, options.device)
    runner = ModelRunner(loaded.model, cache, device, dtype, shard=shard, grammars=grammars)
    capture_graphs(runner, options)  # every rank, in the same order: the graphs all-reduce
    return runner


def load_config_only(options: EngineOptions) -> tuple[LoadedModel, ChatTokenizer]:
    """The model's config and tokenizer without its weights (on the meta device): all that a
    scheduler whose model runs in an executor actor elsewhere needs."""
    loaded = load_model(options.model, "meta", DTYPES[options.dtype], seed=options.seed)
    return loaded, _chat(options, loaded)


def assemble_remote(
    options: EngineOptions, loaded: LoadedModel, chat: ChatTokenizer, runner: RemoteRunner
) -> Built:
    """A fresh engine whose model runs in the executor actor behind `runner`, with the cache
    that executor holds (and its disk tier, if it has one)."""
    cache = remote_cache(options, loaded.config, runner)
    if runner.disk is not None and not (cache.uses_cpu_tier and cache.prefix_sharing):
        raise ValueError(
            "the executor has a disk tier (--disk-cache-dir), which keeps chunks by content key "
            "below the CPU tier: the scheduler needs prefix sharing and a policy with a CPU "
            "tier (pensieve, lru)"
        )
    return _around(runner, cache, options, loaded, chat)


def remote_cache(options: EngineOptions, config: ModelConfig, runner: RemoteRunner) -> CacheConfig:
    """The tiers of a scheduler whose model runs behind `runner`: the executor's blocks, with
    its CPU tier left unused by a policy that has none (`gpu-only`, `stateless`)."""
    info = runner.info
    if info.block_size != options.block_size:
        raise ValueError(
            f"the executor's blocks hold {info.block_size} tokens, this scheduler's "
            f"{options.block_size}: give both one --block-size"
        )
    cache = cache_config(options, config, torch.device("cpu"), DTYPES[options.dtype])
    tiered = options.policy not in (Policy.GPU_ONLY, Policy.STATELESS)
    return dataclasses.replace(
        cache,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks if tiered else 0,
    )


def _around(
    runner: StepRunner,
    cache: CacheConfig,
    options: EngineOptions,
    loaded: LoadedModel,
    chat: ChatTokenizer,
) -> Built:
    scheduling = SchedulerConfig(
        max_num_batched_tokens=options.max_batch_tokens,
        max_num_seqs=options.max_num_seqs,
        max_model_len=context_limit(options.max_model_len, loaded.config, cache),
        admit_batch=options.admit_batch,
        max_step_slowdown=options.max_step_slowdown or None,
        min_prefill_tokens=options.min_prefill_tokens,
    )
    cost = _cost_model(options, loaded.config)
    eos = chat.eos_token_ids
    step_time = _step_time(options, loaded, cost)
    public = _public_keys(options, chat)
    disk = runner.disk if isinstance(runner, ModelRunner | RemoteRunner) else None
    if disk is not None:
        cache = dataclasses.replace(cache, disk_tier=True)
    engine = Engine(
        runner,
        cache,
        scheduling,
        cost.cost,
        eos,
        overlap=options.overlap,
        model_id=model_identity(options),
        step_time=step_time,
        public=public,
        disk=disk,
    )
    return Built(engine, loaded, chat, options)


def _public_keys(options: EngineOptions, chat: ChatTokenizer) -> PublicKeys | None:
    if options.public_prompts is None:
        return None
    public = public_keys(
        Path(options.public_prompts), chat, model_identity(options), options.block_size
    )
    logger.info("public prompts: %d chunks shared across tenants", len(public.keys))
    return public


def model_identity(options: EngineOptions) -> str:
    """What names the model in the KV chunk keys: two engines share a key only if their KV of
    the same tokens is the same (the model, its seed for a preset's random weights, the dtype)."""
    return f"{options.model}|seed={options.seed}|{options.dtype}"


def context_limit(requested: int | None, config: ModelConfig, cache: CacheConfig) -> int:
    """The longest conversation, prompt and reply, that a turn may reach: `requested`
    (--max-model-len), else the model's own context, cut to what the GPU tier holds (a running
    sequence has all of its KV there); that cut is logged. A requested length longer than
    either is refused, as vLLM refuses it."""
    model_len = config.max_context_len
    gpu_tokens = cache.num_gpu_blocks * cache.block_size
    if requested is not None:
        if requested > model_len:
            raise ValueError(
                f"--max-model-len {requested} is longer than the context of {config.name} "
                f"({model_len} tokens)"
            )
        if requested > gpu_tokens:
            raise ValueError(
                f"--max-model-len {requested} does not fit in the GPU tier of {gpu_tokens} "
                "tokens: give a larger tier (--gpu-cache-tokens, --gpu-cache-gb) or a shorter "
                "--max-model-len"
            )
        return requested
    if model_len > gpu_tokens:
        logger.warning(
            "the context of %s (%d tokens) does not fit in the GPU tier of %d tokens: turns are "
            "limited to %d tokens (a larger tier raises the limit; --max-model-len sets it)",
            config.name,
            model_len,
            gpu_tokens,
            gpu_tokens,
        )
        return gpu_tokens
    return model_len


def cache_config(
    options: EngineOptions, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> CacheConfig:
    """Size both tiers in blocks from tokens or GiB; defaults fill most free GPU memory."""
    per_block = config.kv_bytes_per_token(dtype) * options.block_size
    gpu_tokens = _tokens(options.gpu_cache_tokens, options.gpu_cache_gb, per_block, options, "gpu")
    if gpu_tokens is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            gpu_tokens = int(free * DEFAULTS.gpu_memory_fraction) // per_block * options.block_size
        else:
            gpu_tokens = DEFAULTS.cpu_gpu_cache_tokens
    cpu_tokens = _tokens(options.cpu_cache_tokens, options.cpu_cache_gb, per_block, options, "cpu")
    if cpu_tokens is None:
        host_bytes = int(DEFAULTS.cpu_cache_gib * GIB)
        cpu_tokens = (
            4 * gpu_tokens if device.type == "cpu" else host_bytes // per_block * options.block_size
        )
    if options.policy in (Policy.GPU_ONLY, Policy.STATELESS):
        cpu_tokens = 0
    return CacheConfig(
        block_size=options.block_size,
        num_gpu_blocks=gpu_tokens // options.block_size,
        num_cpu_blocks=cpu_tokens // options.block_size,
        policy=options.policy,
        admission_reserve=options.admission_reserve,
        swap_out_threshold=options.swap_out_threshold,
        prefix_sharing=options.prefix_sharing,
    )


def _tokens(
    tokens: int | None, gb: float | None, per_block: int, options: EngineOptions, tier: str
) -> int | None:
    if tokens is not None and gb is not None:
        raise ValueError(f"give --{tier}-cache-tokens or --{tier}-cache-gb, not both")
    if gb is None:
        return tokens
    blocks = int(gb * GIB) // per_block
    least = 2 if tier == "gpu" else 1
    if gb > 0 and blocks < least:
        raise ValueError(
            f"--{tier}-cache-gb {gb:g} holds {blocks} blocks of {options.block_size} tokens of "
            f"this model; it needs {least} at least ({least * per_block / (1 << 20):.2f} MiB)"
        )
    return blocks * options.block_size


def _chat(options: EngineOptions, loaded: LoadedModel) -> ChatTokenizer:
    tokenizer: Any = _tokenizer(options, loaded)
    if options.chat_template is not None:
        path = Path(options.chat_template)
        if not path.is_file():
            raise ModelLoadError(f"chat template not found: {options.chat_template}")
        tokenizer.chat_template = path.read_text()
    chat = ChatTokenizer(tokenizer, loaded.config.vocab_size, options.tool_call_parser)
    logger.info("tool calls read as %s", chat.tool_parser.name)
    return chat


def _tokenizer(options: EngineOptions, loaded: LoadedModel) -> object:
    from transformers import AutoTokenizer

    if options.tokenizer is not None:
        path = Path(options.tokenizer)
        if not path.is_dir():
            raise ModelLoadError(f"tokenizer folder not found: {options.tokenizer}")
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if loaded.tokenizer is not None:
        return loaded.tokenizer
    from pensieve.models.assets import smollm2_tokenizer

    return smollm2_tokenizer()  # presets borrow SmolLM2's tokenizer for realistic lengths


def _cost_model(options: EngineOptions, config: ModelConfig) -> CostModel:
    if options.profile is not None:
        return CostModel.from_json(options.profile)
    return CostModel.analytic(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        chunk_size=options.block_size,
    )


def _step_time(options: EngineOptions, loaded: LoadedModel, cost: CostModel) -> StepTimeModel:
    """The step-time estimate that caps prefill beside decodes: the cost model's per-token and
    attention times, and as the fixed cost of a step the weights one device reads in it (all
    but an input embedding table apart from the output head, whose rows are only gathered)."""
    model = loaded.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        table = model.embed_tokens.weight
        weights -= table.numel() * table.element_size()
    return StepTimeModel.from_cost(cost, weights // options.tensor_parallel)


def freeze_start_up() -> None:
    """Inside `frozen_heap`: leave every object alive now (what an actor loaded after entering
    it: a tokenizer, a model config) out of later collections too."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[float]:
    """While serving: every object alive on entry (the model, compiled kernels, imported modules)
    is left out of Python's garbage collections; yields the seconds one full collection took.

    A full collection walks every tracked object, and the collector starts one on its own as the
    heap grows: with the start-up heap in it, that walk stalls the step loop (and every running
    request) for as long as the collection just measured. Objects made while serving are
    collected as usual. On exit the frozen objects become collectable again (a replay run inside
    a test process must not keep its garbage)."""
    begin = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - begin
    gc.freeze()
    try:
        yield seconds
    finally:
        gc.unfreeze()
