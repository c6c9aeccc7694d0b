"""The options of an engine as a user gives them (`pensieve serve`, `replay`, `actor`: see
`cli_options.py`), each checked before the model loads; `factory.py` builds the engine from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pensieve.actors.config import DEFAULTS, Policy
from pensieve.actors.tokenizer.tool_parsers import PARSERS
from pensieve.store.disk import DiskTierError
from pensieve.store.disk.directory import check_directory


@dataclass(frozen=True)
class EngineOptions:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    tokenizer: str | None = None  # a tokenizer folder; default: the model's own, else SmolLM2's
    chat_template: str | None = None  # a Jinja file in place of the tokenizer's chat template
    tool_call_parser: str | None = None  # see `tool_parsers.py`; None: the template's family
    policy: Policy = Policy.PENSIEVE
    block_size: int = DEFAULTS.block_size
    gpu_cache_tokens: int | None = None  # None: most of the free GPU memory (16k tokens on CPU)
    cpu_cache_tokens: int | None = None  # None: DEFAULTS.cpu_cache_gib (4x the GPU tier on CPU)
    gpu_cache_gb: float | None = None
    cpu_cache_gb: float | None = None
    admission_reserve: float = DEFAULTS.admission_reserve
    swap_out_threshold: float = DEFAULTS.swap_out_threshold
    max_batch_tokens: int = DEFAULTS.max_batch_tokens
    max_num_seqs: int = DEFAULTS.max_num_seqs
    admit_batch: int = DEFAULTS.admit_batch  # see SchedulerConfig.admit_batch
    # see SchedulerConfig.max_step_slowdown (0 or None: off) and .min_prefill_tokens
    max_step_slowdown: float | None = DEFAULTS.max_step_slowdown or None
    min_prefill_tokens: int = DEFAULTS.min_prefill_tokens
    overlap: bool = True  # plan each step while the one before runs (see Engine)
    prefix_sharing: bool = True  # see CacheConfig.prefix_sharing
    # a file of prompts shared across tenants (ops/public_prompts.py); None: none
    public_prompts: str | None = None
    profile: str | None = None  # a `pensieve profile` table; default: the analytic cost model
    seed: int = 0
    cpu_threads: int | None = None  # PyTorch threads of a CPU engine; None: see `cpu_threads`
    # GPUs the model is split over (ops/executor_ranks.py): one executor process for each
    tensor_parallel: int = 1
    # the longest conversation (prompt and reply) a turn may reach; None: see `context_limit`
    max_model_len: int | None = None
    # the disk tier below the CPU tier: an existing directory (a folder per rank is made in
    # it) and its budget in GiB; None: no disk tier. Reading a chunk back is weighed against
    # recomputing it at `disk_read_gbps` GB/s; None: at the rate the tier's reads are measured
    # at (`DEFAULTS.disk_read_gbps` until it has read)
    disk_cache_dir: str | None = None
    disk_cache_gb: float | None = None
    disk_read_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.public_prompts is not None and not self.prefix_sharing:
            raise ValueError("--public-prompts shares prefixes: it needs prefix sharing on")
        self._check_cache_sizes()
        self._check_disk()

    def _check_disk(self) -> None:
        if (self.disk_cache_dir is None) != (self.disk_cache_gb is None):
            raise ValueError("give both --disk-cache-dir and --disk-cache-gb, or neither")
        if self.disk_cache_dir is None:
            return
        if self.disk_cache_gb is not None and self.disk_cache_gb <= 0:
            raise ValueError(f"--disk-cache-gb must be more than 0, got {self.disk_cache_gb:g}")
        if self.disk_read_gbps is not None and self.disk_read_gbps <= 0:
            raise ValueError(f"--disk-read-gbps must be more than 0, got {self.disk_read_gbps:g}")
        if not self.prefix_sharing or self.policy not in (Policy.PENSIEVE, Policy.LRU):
            raise ValueError(
                "--disk-cache-dir keeps chunks by content key below the CPU tier: it needs "
                "prefix sharing and a policy with a CPU tier (pensieve, lru)"
            )
        if self.tensor_parallel > 1:
            raise ValueError("--disk-cache-dir is not yet supported with --tensor-parallel > 1")
        try:  # missing or read-only: a clear error before the model loads
            check_directory(Path(self.disk_cache_dir))
        except DiskTierError as error:
            raise ValueError(str(error)) from None

    @property
    def disk_tier(self) -> bool:
        return self.disk_cache_dir is not None

    def _check_cache_sizes(self) -> None:
        """Each size option named, before the model loads (a GiB size's blocks are counted
        once the model's KV bytes per token are known, in `cache_config`)."""
        block = self.block_size
        if block < 1 or block & (block - 1):
            raise ValueError(f"--block-size must be a power of two, got {block}")
        if self.gpu_cache_tokens is not None and self.gpu_cache_tokens < 2 * block:
            raise ValueError(
                f"--gpu-cache-tokens must hold 2 blocks at least ({2 * block} tokens), got "
                f"{self.gpu_cache_tokens}"
            )
        cpu = self.cpu_cache_tokens
        if cpu is not None and cpu != 0 and cpu < block:
            raise ValueError(
                f"--cpu-cache-tokens must be 0 (no CPU tier) or hold a block ({block} tokens) "
                f"at least, got {cpu}"
            )
        for flag, gb, least in (
            ("--gpu-cache-gb", self.gpu_cache_gb, "more than 0"),
            ("--cpu-cache-gb", self.cpu_cache_gb, "0 (no CPU tier) or more"),
        ):
            if gb is not None and (gb < 0 or (gb == 0 and flag == "--gpu-cache-gb")):
                raise ValueError(f"{flag} must be {least}, got {gb:g}")
