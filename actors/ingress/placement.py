"""Where a turn that names no conversation goes, among the engines on one NATS (pure).

Every ingress replica of every engine decides alone, from what all engines publish: their load
reports (`pensieve.v1.engine.*.load`, `LoadReport`) and their KV events
(`pensieve.v1.engine.*.kv`, applied to a `PrefixIndex`). There is no router process to lose. A
turn of a conversation never comes here: it goes to the engine that holds it.

An engine is a candidate while its last report is younger than `report_ttl_s`. Each candidate
costs, in KV blocks, as NVIDIA Dynamo's KV router weighs a prefix against load:

    cost(e) = prefix_weight * uncached(e) + load(e)
    uncached(e) = the prompt's blocks - its leading chunks that e holds (GPU or CPU tier)
    load(e)     = the blocks of e's turns in hand (their context, running and waiting, as last
                  reported) + the blocks of the turns this ingress placed on e since

and the cheapest wins; on a tie, the one with more free GPU blocks, then any (at random). The
second term keeps a burst of turns placed between two reports from all going to one engine.

    policy   what it reads                          a new conversation   a resent history
    prefix   load reports, KV events, the prompt    by load              by cost(e)
    load     load reports                           by load              by load
    random   load reports (who is alive)            any live engine      any live engine

"prefix" renders a stateless request's prompt (its messages, or its raw prompt) in the ingress
to key its chunks as the engines do (`chunk_keys.turn_namespace`); a new conversation's first
message is not rendered (its prompt is short, and no prefix of it is cached).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pensieve.actors.wire.chunk_keys import ChunkKey, PublicKeys, turn_namespace
from pensieve.actors.wire.messages import LOAD_REPORT_EVERY_S, KvEventBatch, LoadReport
from pensieve.actors.wire.prefix_index import PrefixIndex


class Policy(enum.Enum):
    PREFIX = "prefix"
    LOAD = "load"
    RANDOM = "random"


class Reason(enum.Enum):
    """Why a turn went where it did."""

    ONLY = "only"  # one engine is live (or none has reported: this one)
    LOAD = "load"  # the least loaded; no candidate held a prefix of its prompt worth more
    PREFIX = "prefix"  # the chosen engine holds a leading part of its prompt
    RANDOM = "random"  # the random policy


@dataclass(frozen=True)
class PlacementConfig:
    policy: Policy = Policy.PREFIX
    prefix_weight: float = 1.0  # blocks of load one uncached prompt block is worth
    report_ttl_s: float = 4 * LOAD_REPORT_EVERY_S  # an engine silent this long is not placed on

    def __post_init__(self) -> None:
        if self.prefix_weight < 0 or self.report_ttl_s <= 0:
            raise ValueError("--prefix-weight must be >= 0, and the report TTL > 0")


@dataclass(frozen=True)
class PromptKeys:
    """How the engines key a prompt's chunks: their model's identity in the keys, their block
    size, and the operator's public prompts (None: none)."""

    model: str
    block_size: int
    public: PublicKeys | None = None

    def of(
        self, token_ids: Sequence[int], tenant: str | None, cache_salt: str | None
    ) -> list[ChunkKey]:
        space = turn_namespace(self.model, self.public, tenant, cache_salt)
        return space.keys_of(token_ids, self.block_size)


@dataclass(frozen=True)
class Choice:
    engine_id: str
    reason: Reason
    num_cached_blocks: int = 0  # of the prompt, on that engine
    cost: float = 0.0


@dataclass
class _Engine:
    report: LoadReport
    received: float  # monotonic
    num_placed_blocks: int = 0  # placed here by this ingress since the report

    @property
    def load(self) -> int:
        report = self.report
        return math.ceil(report.num_active_tokens / report.block_size) + self.num_placed_blocks


class Placement:
    """The engines' load and cached prefixes as one ingress sees them, and its choices."""

    def __init__(
        self, engine_id: str, config: PlacementConfig, rng: random.Random | None = None
    ) -> None:
        self.engine_id = engine_id  # this ingress's: where a turn goes when nothing is known
        self.config = config
        self.prefixes = PrefixIndex()
        self._engines: dict[str, _Engine] = {}
        self._rng = rng or random.Random()

    def report(self, report: LoadReport, now: float) -> None:
        """An engine's load report, received at `now` (monotonic). One older than the report
        in hand (the periodic report of a snapshot taken before a turn ended, after the report
        sent as it ended) says only that the engine lives."""
        seen = self._engines.get(report.engine_id)
        if seen is None or report.time >= seen.report.time:
            self._engines[report.engine_id] = _Engine(report, now)
        else:
            seen.received = now

    def kv_events(self, batch: KvEventBatch) -> None:
        self.prefixes.apply(batch)

    def live(self, now: float) -> list[str]:
        """The engines whose last report is younger than the TTL."""
        ttl = self.config.report_ttl_s
        return [e for e, seen in self._engines.items() if now - seen.received < ttl]

    def wants_prompt(self, now: float) -> bool:
        """Whether a stateless turn's prompt would change its placement (its keys are worth
        rendering it for)."""
        return self.config.policy is Policy.PREFIX and len(self.live(now)) > 1

    def place(
        self, now: float, keys: Sequence[ChunkKey] = (), num_prompt_tokens: int = 0
    ) -> Choice:
        """Where a turn goes: one whose prompt is `num_prompt_tokens` tokens keyed `keys` (none
        for a new conversation, or under a policy that does not read prompts)."""
        live = self.live(now)
        if len(live) <= 1:
            return Choice(live[0] if live else self.engine_id, Reason.ONLY)
        if self.config.policy is Policy.RANDOM:
            choice = Choice(self._rng.choice(live), Reason.RANDOM)
        else:
            choice = self._cheapest(live, keys, num_prompt_tokens)
        block_size = self._engines[choice.engine_id].report.block_size
        self._engines[choice.engine_id].num_placed_blocks += max(
            1, math.ceil(num_prompt_tokens / block_size)
        )
        return choice

    def _cheapest(self, live: list[str], keys: Sequence[ChunkKey], num_tokens: int) -> Choice:
        matches = self.prefixes.match(keys) if keys else {}
        weight = self.config.prefix_weight
        choices, ranks = [], []
        for engine_id in live:
            seen = self._engines[engine_id]
            match = matches.get(engine_id)
            num_cached = match.num_chunks if match is not None else 0
            num_blocks = math.ceil(num_tokens / seen.report.block_size)
            cost = weight * max(num_blocks - num_cached, 0) + seen.load
            reason = Reason.PREFIX if num_cached else Reason.LOAD
            choices.append(Choice(engine_id, reason, num_cached, cost))
            ranks.append((cost, -seen.report.num_free_blocks, self._rng.random()))
        return min(zip(ranks, choices, strict=True), key=lambda pair: pair[0])[1]
