"""The recompute planner's actor: for a turn whose history has dropped chunks, which positions
must be recomputed from the raw tokens. It is asked when the turn arrives, so admission never waits.

Subject `pensieve.internal.<engine>.recompute-planner.plan` (queue group `recompute-planner`): a
`RecomputePlanRequest` in, a `RecomputePlan` back. The planner follows the engine's KV event
plane (`pensieve.v1.engine.<id>.kv`) into its core (`RecomputePlanner`, `recompute.py`) and
reads the conversation's token log from LMDB on a worker thread. A plan describes the tiers as
of the last batch applied; the scheduler's admission (`KVCacheManager.acquire`) still decides,
so a late or missing plan loses only the early warning.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.planner.recompute import RecomputePlanner
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.calls import PLAN, RECOMPUTE_PLANNER
from pensieve.actors.wire.incoming import Incoming
from pensieve.actors.wire.messages import (
    RecomputePlan,
    RecomputePlanRequest,
    decode,
    decode_kv_events,
    encode,
)
from pensieve.actors.wire.schemas import ApiError
from pensieve.store import ConversationStore

logger = logging.getLogger(__name__)


class RecomputePlannerActor(Actor):
    """The planner's shell: one engine's KV events in (a mailbox, in order), plans out (an
    endpoint, a task per request). Every replica follows the events itself."""

    name = RECOMPUTE_PLANNER
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
