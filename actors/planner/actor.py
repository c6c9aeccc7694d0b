"""The recompute planner: for a turn whose history has dropped chunks, which positions must be
recomputed from the raw tokens. It is asked when the turn arrives, so admission never waits.

Subject `pensieve.internal.<engine>.recompute-planner.plan` (queue group `recompute-planner`): a
`RecomputePlanRequest` in, a `RecomputePlan` back. The planner follows the engine's KV event
plane (`pensieve.v1.engine.<id>.kv`) into a `TierMap` and reads the conversation's token log from
LMDB on a worker thread. A plan describes the tiers as of the last batch applied; the scheduler's
admission (`KVCacheManager.acquire`) still decides, so a late or missing plan loses only the
early warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence

import msgspec
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.scheduler.kv.kv_cache import Tier
from pensieve.actors.scheduler.kv.kv_events import SequenceGap, TierMap
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Bus, Incoming
from pensieve.actors.wire.messages import (
    KvEventBatch,
    KvEventKind,
    MessageError,
    RecomputePlan,
    RecomputePlanRequest,
    decode,
    decode_kv_events,
    encode,
)
from pensieve.actors.wire.schemas import ApiError
from pensieve.store import ConversationStore

logger = logging.getLogger(__name__)

PLAN = "plan"
PLAN_TIMEOUT_S = 0.5  # what a caller gives one plan by default: it must never hold a turn up


@dataclasses.dataclass
class _Seen:
    """What events have said about one conversation's chunks since the planner lost track."""

    indices: set[int] = dataclasses.field(default_factory=set)  # placed by an event
    removed_from: int | None = None  # every chunk from this index on was removed


class RecomputePlanner:
    """Which positions of a conversation's history are in no tier, from the engine's KV events.

    A plan is never built from a chunk whose place may have changed unseen:
      - a seq-1 batch (a fresh engine process, whose tiers start empty) makes every chunk known:
        a conversation absent from the map has none anywhere, so all of it is recomputed;
      - before the first batch, and after a gap in seq (a lost batch, or a planner that
        subscribed late), a chunk is known only once an event placed it (each event says where
        its chunk is afterwards) or removed it since. A plan that needs any other chunk is
        unknown until the next seq-1 batch or until events have placed it.
    A restarted engine keeps its id; the planner sees the restart only at its first batch.
    """

    def __init__(self) -> None:
        self.tier_map = TierMap()
        self._seen: dict[str, _Seen] | None = {}  # None: every chunk is known

    @property
    def synced(self) -> bool:
        """Whether every chunk's place is known (since a seq-1 batch, with no gap after it)."""
        return self._seen is None

    def apply(self, batch: KvEventBatch) -> None:
        """Follow one batch of the engine's KV events (batches come in the order published)."""
        try:
            self.tier_map.apply(batch)
        except SequenceGap:
            self._resume(batch)
            return
        if batch.seq == 1:
            self._seen = None
        self._note(batch)

    def plan(
        self, conv_id: str, token_log: Sequence[int], num_positions: int, block_size: int
    ) -> RecomputePlan:
        """Where the KV of the conversation's first `num_positions` positions is, for chunks of
        `block_size` positions. Only the positions before the log's last token have KV: that
        token was sampled, never fed, so it and every position past the log are new."""
        log_len = len(token_log)
        history = min(num_positions, max(log_len - 1, 0))
        num_chunks = -(-history // block_size)
        if not self._knows(conv_id, num_chunks):
            return RecomputePlan(conv_id, False, log_len, history, (), 0, 0, 0)
        tiers = self.tier_map.tiers(conv_id)  # absent: every chunk dropped
        ranges: list[tuple[int, int]] = []
        num_tokens = dict.fromkeys(Tier, 0)
        for i in range(num_chunks):
            start, end = i * block_size, min((i + 1) * block_size, history)
            tier = tiers[i] if i < len(tiers) else Tier.DROPPED
            num_tokens[tier] += end - start
            if tier is Tier.DROPPED:
                _extend(ranges, start, end)
        recomputed, gpu, cpu = (num_tokens[t] for t in (Tier.DROPPED, Tier.GPU, Tier.CPU))
        return RecomputePlan(conv_id, True, log_len, history, tuple(ranges), recomputed, gpu, cpu)

    def _resume(self, batch: KvEventBatch) -> None:
        """After a gap: a map of what `batch` and the batches after it say, and nothing more.
        A batch numbered at or before the last one (a second publisher under this engine's id)
        is not trusted either: the map starts empty after it."""
        ahead = batch.seq > self.tier_map.last_seq
        logger.warning(
            "KV events of engine %s: batch %d after batch %d; plans wait for the "
            "chunks to be placed again",
            batch.engine_id,
            batch.seq,
            self.tier_map.last_seq,
        )
        self.tier_map, self._seen = TierMap(), {}
        if ahead:
            self.tier_map.apply(msgspec.structs.replace(batch, seq=1))  # an empty map, then these
            self._note(batch)
        self.tier_map.last_seq = batch.seq  # the engine's numbering goes on from here

    def _note(self, batch: KvEventBatch) -> None:
        if self._seen is None:
            return
        for event in batch.events:
            seen = self._seen.setdefault(event.conversation_id, _Seen())
            if event.kind is KvEventKind.REMOVED:
                floor = seen.removed_from
                seen.removed_from = event.index if floor is None else min(floor, event.index)
            else:
                seen.indices.add(event.index)

    def _knows(self, conv_id: str, num_chunks: int) -> bool:
        if self._seen is None:
            return True
        seen = self._seen.get(conv_id, _Seen())
        floor = num_chunks if seen.removed_from is None else seen.removed_from
        return all(i in seen.indices for i in range(min(floor, num_chunks)))


def _extend(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """Append [start, end), merged into the last range if it ends at `start`."""
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))


class RecomputePlannerActor(Actor):
    """The planner's shell: one engine's KV events in (a mailbox, in order), plans out (an
    endpoint, a task per request). Every replica follows the events itself."""

    name = "recompute-planner"
    description = "which positions of a turn's history must be recomputed (its dropped chunks)"

    def __init__(self, bus: Bus, engine_id: str, store: ConversationStore, block_size: int) -> None:
        super().__init__(bus, engine_id)
        self.store = store
        self.block_size = block_size  # the engine's (`CacheConfig.block_size`)
        self.planner = RecomputePlanner()

    async def setup(self) -> None:
        await self.bus.mailbox(subjects.kv_events(self.engine_id), self._follow)
        await self.serve(PLAN, self._plan)

    async def _follow(self, data: bytes, headers: dict[str, str]) -> None:
        try:
            self.planner.apply(decode_kv_events(data))
        except ValueError as error:  # unreadable, or another engine's: the next batch shows a gap
            logger.warning(
                "a KV event batch of engine %s was not applied: %s", self.engine_id, error
            )

    async def _plan(self, msg: Incoming) -> None:
        parent = propagate.extract(msg.headers)
        tracer = tracing.tracer(self.name)  # under the service pensieve-recompute-planner
        with tracer.start_as_current_span(
            "kv.plan_recompute", context=parent, kind=SpanKind.SERVER, record_exception=False
        ) as span:
            try:
                plan = await self._planned(msg.data)
            except ApiError as error:
                tracing.record_refusal(span, error)
                raise
            span.set_attributes(
                {
                    "pensieve.conversation_id": plan.conversation_id,
                    "pensieve.plan_known": plan.known,
                    "pensieve.recomputed_tokens": plan.recomputed_tokens,
                    "pensieve.ranges": [f"{start}-{end}" for start, end in plan.ranges],
                }
            )
            await msg.send(encode(plan))

    async def _planned(self, data: bytes) -> RecomputePlan:
        try:
            request = decode(data, RecomputePlanRequest)
            log = await asyncio.to_thread(self.store.token_log, request.conversation_id)
        except ValueError as error:  # MessageError, or an id the store refuses
            raise ApiError("invalid_request", str(error)) from None
        # planned after the read, from the freshest map
        num_positions = len(log) if request.num_positions is None else request.num_positions
        return self.planner.plan(request.conversation_id, log, num_positions, self.block_size)


async def plan_remote(
    bus: Bus,
    engine_id: str,
    conv_id: str,
    num_positions: int | None = None,
    timeout_s: float = PLAN_TIMEOUT_S,
) -> RecomputePlan | None:
    """Engine `engine_id`'s plan for the conversation's first `num_positions` positions (None:
    its whole stored log), in the caller's trace. None if no planner answers within `timeout_s`
    (none subscribed, or silence) or its answer is not a plan (an error, logged): the caller
    goes on without one, it never waits longer."""
    subject = subjects.internal(engine_id, RecomputePlannerActor.name, PLAN)
    body = encode(RecomputePlanRequest(conv_id, num_positions))
    headers: dict[str, str] = {}
    propagate.inject(headers)  # W3C traceparent: the planner's span is the caller's child
    try:
        async with contextlib.aclosing(bus.ask(subject, body, timeout_s, headers)) as answer:
            data = await anext(answer)
    except (TimeoutError, ConnectionError):
        return None
    try:
        return decode(data, RecomputePlan)
    except MessageError:
        logger.warning("the recompute planner of engine %s answered %r", engine_id, data[:200])
        return None
