"""Engine configuration: frozen dataclasses validated once and passed explicitly, and the one
table of defaults that the CLI, the engine factory and the benchmarks all read."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass


class StepChannel(enum.Enum):
    """How the engine reaches its model: the executor actor over the bus, or a direct call."""

    NATS = "nats"  # step plans and tokens as messages to and from the executor actor
    DIRECT = "direct"  # the scheduler calls the model in its own thread (no executor actor)


class AllReduce(enum.Enum):
    """How tensor-parallel ranks sum the row-parallel layers' partial products."""

    NCCL = "nccl"  # the process group's own all-reduce
    PEER = "peer"  # symmetric memory on GPUs (one kernel reads every rank's share over NVLink)


@dataclass(frozen=True)
class Defaults:
    """The engine's tunable defaults, in one place."""

    block_size: int = 32  # tokens per KV block, which is also the eviction chunk
    admission_reserve: float = 0.10  # admit new requests only while more of the GPU is free
    swap_out_threshold: float = 0.25  # swap out ahead of time while less of the GPU is free
    max_batch_tokens: int = 2048  # token budget of one step (prefill and decode together)
    max_num_seqs: int = 256  # running requests at most
    # while sessions decode, a step's prefill keeps its estimated time within this factor of
    # a decode-only step's (actors/scheduler/step_budget.py), taking at least this many tokens;
    # 0: off (prefill takes the whole token budget) until the estimate is checked on GPUs
    max_step_slowdown: float = 0.0
    min_prefill_tokens: int = 32
    admit_batch: int = 8  # a decode-only step admits once this many running slots are free
    max_waiting: int = 1024  # turns queued before `serve` answers "overloaded"
    nats_port: int = 4222  # the port `serve` starts its own nats-server on
    shutdown_grace_s: float = 20.0  # on SIGTERM, turns in flight get this long to finish
    tokenizers: int = 2  # tokenizer replicas `serve` starts (a queue group on the bus)
    conversation_ttl_s: float = 7 * 24 * 3600.0  # an idle conversation is deleted after this
    stateless_ttl_s: float = 3600.0  # ... or after this, if stateless-made or ended
    http_read_timeout_s: float = 15.0  # for an HTTP request's headers, then its body
    http_max_connections: int = 1024  # HTTP connections open at once
    # in one process the executor is called in-thread: threads of one process that pass plans
    # over NATS share the interpreter lock and serve fewer tokens (docs/benchmarks.md)
    step_channel: StepChannel = StepChannel.DIRECT
    max_tokens: int = 256  # output tokens of a turn whose request names none
    gpu_memory_fraction: float = 0.85  # of the free GPU memory, for the GPU tier
    cpu_cache_gib: float = 8.0  # the CPU tier on a GPU machine (4x the GPU tier on a CPU one)
    cpu_gpu_cache_tokens: int = 16384  # the "GPU" tier when the model runs on the CPU
    disk_read_gbps: float = 2.0  # a local NVMe drive's read rate, roughly (the disk tier)
    # the executor's switches (see `ExecutorConfig`): on in serving, off only to compare
    mixed_graphs: bool = True
    fast_launch: bool = True
    all_reduce: AllReduce = AllReduce.NCCL


DEFAULTS = Defaults()

# the environment variables that override `ExecutorConfig`'s defaults, read only here
MIXED_GRAPHS_ENV = "PENSIEVE_MIXED_GRAPHS"  # "0": steps with prefill pieces run eagerly
FAST_LAUNCH_ENV = "PENSIEVE_FAST_LAUNCH"  # "0": every Triton launch goes through Triton
ALL_REDUCE_ENV = "PENSIEVE_ALL_REDUCE"  # "nccl" or "peer"


@dataclass(frozen=True)
class ExecutorConfig:
    """How the executor runs a step: steps with prefill pieces from CUDA graphs cut at attention
    (`mixed_graphs`), Triton kernels launched through their compiled launchers (`fast_launch`),
    and how tensor-parallel ranks sum (`all_reduce`). Benchmarks turn them off side by side."""

    mixed_graphs: bool = DEFAULTS.mixed_graphs
    fast_launch: bool = DEFAULTS.fast_launch
    all_reduce: AllReduce = DEFAULTS.all_reduce

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ExecutorConfig:
        """The defaults, overridden where the environment sets PENSIEVE_MIXED_GRAPHS,
        PENSIEVE_FAST_LAUNCH ("0": off) or PENSIEVE_ALL_REDUCE; ValueError for a mode unknown."""
        mode = environ.get(ALL_REDUCE_ENV) or DEFAULTS.all_reduce.value
        modes = [m.value for m in AllReduce]
        if mode not in modes:
            raise ValueError(f"{ALL_REDUCE_ENV}={mode!r}: one of {', '.join(modes)}")
        return cls(
            mixed_graphs=environ.get(MIXED_GRAPHS_ENV, "1") != "0",
            fast_launch=environ.get(FAST_LAUNCH_ENV, "1") != "0",
            all_reduce=AllReduce(mode),
        )


@dataclass(frozen=True)
class ExpiryConfig:
    """How long an idle conversation is kept: `stateless_ttl_s` for one made by a stateless
    request (its client keeps the history and makes a new one each time) or ended by a final
    turn, `conversation_ttl_s` for any other."""

    conversation_ttl_s: float = DEFAULTS.conversation_ttl_s
    stateless_ttl_s: float = DEFAULTS.stateless_ttl_s

    def __post_init__(self) -> None:
        if not self.conversation_ttl_s > 0 or not self.stateless_ttl_s > 0:
            raise ValueError("--conversation-ttl and --stateless-ttl must be > 0")

    def ttl_s(self, short: bool) -> float:
        return self.stateless_ttl_s if short else self.conversation_ttl_s

    @property
    def sweep_interval_s(self) -> float:
        """A tenth of the shorter TTL, so a conversation outlives its TTL by 10% at most, within
        [1 s, 60 s]: a sweep reads every conversation's meta."""
        return min(max(min(self.conversation_ttl_s, self.stateless_ttl_s) / 10, 1.0), 60.0)


DEFAULT_EXPIRY = ExpiryConfig()


class Policy(enum.Enum):
    """Cache policies: `pensieve` and three baselines for ablations."""

    PENSIEVE = "pensieve"  # two tiers, evict lowest Cost(l)/T first
    LRU = "lru"  # two tiers, evict the least recently active conversation first
    GPU_ONLY = "gpu-only"  # no CPU tier: evicted chunks are dropped
    STATELESS = "stateless"  # forget every conversation after its turn


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULTS.block_size
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    policy: Policy = Policy.PENSIEVE
    swap_out_threshold: float = DEFAULTS.swap_out_threshold
    admission_reserve: float = DEFAULTS.admission_reserve
    # full chunks are found by content (any conversation of the namespace), not only by the
    # conversation's own token log (`kv/chunk_keys.py`)
    prefix_sharing: bool = True
    # chunks the CPU tier evicts go to the executor's disk tier by content key, and come back
    # from it (`actors/executor/disk_cache.py`); needs prefix sharing (the keys)
    disk_tier: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks < 2:
            raise ValueError(f"need at least 2 GPU blocks, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        if not 0.0 <= self.admission_reserve < 1.0 or not 0.0 <= self.swap_out_threshold < 1.0:
            raise ValueError("admission_reserve and swap_out_threshold must be in [0, 1)")

    @property
    def uses_cpu_tier(self) -> bool:
        return self.num_cpu_blocks > 0 and self.policy in (Policy.PENSIEVE, Policy.LRU)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULTS.max_batch_tokens
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_model_len: int = 8192
    # a step that would decode only admits waiting requests once this many can start together
    # (capped at max_num_seqs / 8, and at the number waiting): see `Scheduler.schedule`
    admit_batch: int = DEFAULTS.admit_batch
    # prefill beside decodes keeps a step within this factor of a decode-only step's estimated
    # time (None: off, prefill takes the whole token budget), with at least `min_prefill_tokens`
    # a step; it applies to a scheduler given a step-time model (step_budget.py)
    max_step_slowdown: float | None = DEFAULTS.max_step_slowdown or None
    min_prefill_tokens: int = DEFAULTS.min_prefill_tokens

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("scheduler limits must be positive")
        if self.admit_batch < 1:
            raise ValueError(f"admit_batch must be >= 1, got {self.admit_batch}")
        if self.max_step_slowdown is not None and self.max_step_slowdown < 1:
            raise ValueError(f"max_step_slowdown must be >= 1, got {self.max_step_slowdown}")
        if self.min_prefill_tokens < 1:
            raise ValueError(f"min_prefill_tokens must be >= 1, got {self.min_prefill_tokens}")

    @property
    def admit_group(self) -> int:
        """Running-request slots that must be free before a decode-only step admits."""
        return max(1, min(self.admit_batch, self.max_num_seqs // 8))
