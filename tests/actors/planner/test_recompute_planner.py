"""The recompute planner: its core against hand-made KV event batches and against the cache
manager's own admission, and its actor over a real nats-server with a real LMDB store, last with
the real SmolLM2 engine, whose admission must recompute exactly the ranges the planner gave."""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from pensieve.actors.config import CacheConfig, Policy
from pensieve.actors.planner.actor import RecomputePlannerActor
from pensieve.actors.planner.recompute import RecomputePlanner
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.scheduler.kv.kv_cache import Acquired, ConversationKV
from pensieve.actors.scheduler.kv.kv_events import KvEventStream
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.scheduler.kv.tier_moves import OutOfBlocks
from pensieve.actors.scheduler.request import common_prefix
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.calls import plan_remote
from pensieve.actors.wire.incoming import ERROR_HEADER
from pensieve.actors.wire.messages import (
    KvEvent,
    KvEventBatch,
    KvEventKind,
    MessageError,
    RecomputePlan,
    decode,
    encode,
    encode_kv_events,
)
from pensieve.actors.wire.request_parsing import parse_chat
from pensieve.actors.wire.schemas import ApiError
from pensieve.models.loader import LoadedModel
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore, StoreWriter
from pensieve.store.records import TurnRecord

K = KvEventKind
SERVICE = subjects.actor_service("recompute-planner")
LOG = list(range(100, 123))  # 23 tokens: 22 positions of KV in chunks of 4, the last one partial


def events_of_c(stream: KvEventStream) -> list[KvEventBatch]:
    """Conversation c's six chunks stored, then: 0 and 1 dropped, 2 on the CPU only, 3 swapped
    out with its GPU block kept (still a GPU hit), 4 dropped, 5 left on the GPU."""
    stored = [KvEvent(K.STORED, "c", i, i, None) for i in range(6)]
    moved = [
        KvEvent(K.DROPPED, "c", 0),
        KvEvent(K.DROPPED, "c", 1),
        KvEvent(K.RECLAIMED, "c", 2, None, 7),
        KvEvent(K.SWAPPED_OUT, "c", 3, 3, 8),
        KvEvent(K.DROPPED, "c", 4),
    ]
    return [stream.batch(stored), stream.batch(moved)]


def fed(batches: list[KvEventBatch]) -> RecomputePlanner:
    planner = RecomputePlanner()
    for batch in batches:
        planner.apply(batch)
    return planner


def test_dropped_chunks_are_merged_into_ranges_and_the_rest_is_counted_by_tier() -> None:
    planner = fed(events_of_c(KvEventStream("e")))
    assert planner.plan("c", LOG, len(LOG), 4) == RecomputePlan(
        "c", True, 23, 22, ((0, 8), (16, 20)), recomputed_tokens=12, gpu_tokens=6, cpu_tokens=4
    )
    # the first 6 positions only: chunk 1 is cut at 6; past the log's last token all is new
    assert planner.plan("c", LOG, 6, 4).ranges == ((0, 6),)
    assert planner.plan("c", LOG, 1000, 4) == planner.plan("c", LOG, 22, 4)


def test_a_conversation_the_engine_never_placed_is_recomputed_whole() -> None:
    planner = fed(events_of_c(KvEventStream("e")))
    fresh = planner.plan("d", LOG, len(LOG), 4)
    assert fresh.known and fresh.ranges == ((0, 22),) and fresh.recomputed_tokens == 22
    assert planner.plan("d", [], 0, 4) == RecomputePlan("d", True, 0, 0, (), 0, 0, 0)


def test_after_a_gap_only_chunks_placed_since_are_planned() -> None:
    stream, planner = KvEventStream("e"), RecomputePlanner()
    assert not planner.plan("c", LOG, 23, 4).known  # no batch yet: the engine may be running
    planner.apply(stream.batch([KvEvent(K.STORED, "c", i, i, None) for i in range(6)]))
    planner.apply(stream.batch([KvEvent(K.STORED, "d", 0, 6, None)]))
    assert planner.synced and planner.plan("c", LOG, 23, 4).gpu_tokens == 22
    stream.batch([KvEvent(K.DROPPED, "c", 1)])  # lost on the way
    planner.apply(stream.batch([KvEvent(K.DROPPED, "c", 0)]))
    assert not planner.synced
    assert not planner.plan("c", LOG, 23, 4).known  # chunks 1 to 5 may have moved meanwhile
    assert planner.plan("c", LOG, 4, 4).ranges == ((0, 4),)  # chunk 0 is known again
    assert not planner.plan("d", LOG, 23, 4).known and not planner.plan("x", LOG, 23, 4).known
    planner.apply(stream.batch([KvEvent(K.REMOVED, "d", 0)]))  # d forgotten: nothing left
    assert planner.plan("d", LOG, 23, 4).ranges == ((0, 22),)
    moved = [KvEvent(K.SWAPPED_OUT, "c", i, i, i) for i in range(1, 5)]
    planner.apply(stream.batch([*moved, KvEvent(K.REMOVED, "c", 5)]))
    plan = planner.plan("c", LOG, 23, 4)
    assert plan.known and plan.ranges == ((0, 4), (20, 22)) and plan.gpu_tokens == 16

    repeated = stream.batch([])
    planner.apply(repeated)
    planner.apply(repeated)  # a second publisher under this id: nothing is trusted
    assert not planner.plan("c", LOG, 4, 4).known
    planner.apply(KvEventStream("e").batch([KvEvent(K.STORED, "y", 0, 0, None)]))  # restarted
    assert planner.synced and planner.plan("c", LOG, 23, 4).ranges == ((0, 22),)


def cost(context: int) -> float:
    return 1.0 + context / 100


@pytest.mark.parametrize("seed", range(4))
def test_every_plan_is_what_the_cache_manager_admits(seed: int) -> None:
    """Random turns, forgets and swap-outs on a small two-tier cache; before every admission
    the planner, fed only the events, gives the ranges and counts `acquire` then takes."""
    rng = random.Random(seed)
    config = CacheConfig(4, 10, 6, Policy.PENSIEVE, swap_out_threshold=0.5)
    kv, stream, planner = KVCacheManager(config, cost), KvEventStream("e"), RecomputePlanner()
    kv.take_events()
    forgotten: dict[str, int] = {}  # conversation -> its positions, known from its log only
    num_checked = num_partial = 0
    for step in range(300):
        now = float(step)
        conv_id = f"c{rng.randrange(6)}"
        conv = kv.get(conv_id)
        if conv is not None and conv.num_positions > 28:  # ended: a new one takes its name
            kv.forget(conv_id)
        elif conv is not None and rng.random() < 0.05:  # known from its log only from here
            forgotten[conv_id] = conv.num_positions
            kv.forget(conv_id)
        planner.apply(stream.batch(kv.take_events()))
        num_positions = forgotten.get(conv_id) or getattr(kv.get(conv_id), "num_positions", 0)
        log = list(range(num_positions + 1)) if num_positions else []
        plan = planner.plan(conv_id, log, len(log), config.block_size)
        conv = kv.restore(conv_id, forgotten.pop(conv_id), now) if conv_id in forgotten else None
        acquired = _admit(kv, conv or kv.conversation(conv_id, now), rng.randrange(1, 12), now)
        if acquired is not None:
            assert plan.ranges == acquired.recompute_ranges
            assert (plan.gpu_tokens, plan.cpu_tokens) == (acquired.gpu_tokens, acquired.cpu_tokens)
            num_checked += 1
            num_partial += bool(plan.ranges) and plan.recomputed_tokens < plan.num_positions
        kv.take_orders()
        if rng.random() < 0.3:
            kv.swap_out_ahead(now + 0.5)
    assert planner.synced and num_checked > 100 and num_partial > 5


def _admit(kv: KVCacheManager, conv: ConversationKV, grow: int, now: float) -> Acquired | None:
    """One turn of `grow` new positions, as the scheduler admits and ends it."""
    target = conv.num_positions + grow
    try:
        acquired = kv.acquire(conv, target, now)
    except OutOfBlocks:
        return None
    conv.num_positions = target
    kv.release(conv, now + 0.25)
    return acquired


def test_a_plan_decodes_as_sent_and_a_malformed_one_is_refused() -> None:
    plan = fed(events_of_c(KvEventStream("e"))).plan("c", LOG, 23, 4)
    assert decode(encode(plan), RecomputePlan) == plan
    body = orjson.loads(encode(plan))
    assert body["v"] == 1 and body["ranges"] == [[0, 8], [16, 20]]
    for bad in (
        {"ranges": [[4, 4]]},
        {"ranges": [[0, 1, 2]]},
        {"gpu_tokens": -1},
        {"known": 1},
        {"v": 2},
    ):
        with pytest.raises(MessageError):
            decode(orjson.dumps({**body, **bad}), RecomputePlan)


# ---- the actor, over a real nats-server ------------------------------------------------------


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with EmbeddedNats() as server:
        yield server.url


def commit(store: ConversationStore, conv_id: str, tokens: list[int]) -> None:
    record = TurnRecord(
        0,
        "hi",
        "hello",
        len(tokens) - 1,
        len(tokens) - 1,
        (tokens[-1],),
        "stop",
        0,
        0,
        0,
        started_at=1.0,
        finished_at=2.0,
    )
    store.commit_turn(conv_id, record, 0, tokens)


def test_the_actor_answers_the_plan_of_its_core(url: str, tmp_path: Path) -> None:
    engine_id = secrets.token_hex(4)
    batches = events_of_c(KvEventStream(engine_id))
    local = fed(batches)

    async def go() -> list[RecomputePlan | None]:
        with ConversationStore(tmp_path) as store:
            commit(store, "c", LOG)
            commit(store, "d", LOG[:9])
            async with RecomputePlannerActor(await Bus.connect(url), engine_id, store, 4):
                bus = await Bus.connect(url)
                try:
                    for batch in batches:
                        await bus.publish(subjects.kv_events(engine_id), encode_kv_events(batch))
                    asks = [("c", None), ("c", 6), ("d", None), ("never", None)]
                    return [await plan_remote(bus, engine_id, c, n, 5.0) for c, n in asks]
                finally:
                    await bus.close()

    plans = asyncio.run(go())
    assert plans == [
        local.plan("c", LOG, 23, 4),
        local.plan("c", LOG, 6, 4),
        local.plan("d", LOG[:9], 9, 4),
        RecomputePlan("never", True, 0, 0, (), 0, 0, 0),
    ]
    assert plans[0] is not None and plans[0].ranges == ((0, 8), (16, 20))


def test_without_a_planner_there_is_no_plan_and_no_wait(url: str) -> None:
    async def go() -> None:
        bus = await Bus.connect(url)
        try:
            engine_id = secrets.token_hex(4)
            begin = time.monotonic()
            assert await plan_remote(bus, engine_id, "c", timeout_s=5.0) is None
            # "no responders" comes back at once, not after the 5 s timeout (a loaded CI
            # machine can stall a moment: the bound leaves room)
            assert time.monotonic() - begin < 2.5
            subject = subjects.internal(engine_id, "recompute-planner", "plan")
            hung = await bus.client.subscribe(subject)  # a planner that hangs: silence
            await bus.flush()
            begin = time.monotonic()
            assert await plan_remote(bus, engine_id, "c", timeout_s=0.3) is None
            assert 0.3 <= time.monotonic() - begin < 2.5  # its timeout, not the bus's
            await hung.unsubscribe()  # else closing waits for its unread request
        finally:
            await bus.close()

    asyncio.run(go())


def test_the_planner_answers_the_service_protocol_and_refuses_what_it_cannot_read(
    url: str, tmp_path: Path
) -> None:
    async def go() -> None:
        engine_id = secrets.token_hex(4)
        subject = subjects.internal(engine_id, "recompute-planner", "plan")
        with ConversationStore(tmp_path) as store:
            planner = RecomputePlannerActor(await Bus.connect(url), engine_id, store, 4)
            async with planner:
                bus = await Bus.connect(url)
                try:
                    ping = await bus.client.request(f"$SRV.PING.{SERVICE}", b"", timeout=5)
                    assert orjson.loads(ping.data)["id"] == planner.instance_id
                    info = await bus.client.request(f"$SRV.INFO.{SERVICE}", b"", timeout=5)
                    (endpoint,) = orjson.loads(info.data)["endpoints"]
                    assert endpoint["subject"] == subject
                    assert endpoint["queue_group"] == "recompute-planner"
                    for body in (
                        b"{not json",
                        b'{"v": 1, "conversation_id": 7}',
                        b'{"v": 1, "conversation_id": ""}',
                    ):
                        reply = await bus.client.request(subject, body, timeout=5)
                        assert (reply.headers or {})[ERROR_HEADER] == "invalid_request"
                    assert await plan_remote(bus, engine_id, "", timeout_s=5.0) is None
                    assert await plan_remote(bus, engine_id, "c", timeout_s=5.0) is not None
                finally:
                    await bus.close()

    asyncio.run(go())


def test_a_plan_is_a_span_in_the_callers_trace(url: str, tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    installed = setup_tracing(exporter)
    trace_id, caller = 0x7E57000000000000000000000000C0DE, 0x00000000CA11E402
    parent = SpanContext(trace_id, caller, is_remote=False, trace_flags=TraceFlags(1))
    engine_id = secrets.token_hex(4)

    async def go() -> None:
        with ConversationStore(tmp_path) as store:
            commit(store, "c", LOG)
            async with RecomputePlannerActor(await Bus.connect(url), engine_id, store, 4):
                bus = await Bus.connect(url)
                try:
                    for batch in events_of_c(KvEventStream(engine_id)):
                        await bus.publish(subjects.kv_events(engine_id), encode_kv_events(batch))
                    with trace.use_span(NonRecordingSpan(parent)):
                        assert await plan_remote(bus, engine_id, "c", timeout_s=5.0)
                finally:
                    await bus.close()

    try:
        asyncio.run(go())
        (span,) = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    finally:
        assert installed is not None
        installed.shutdown()
    assert span.name == "kv.plan_recompute"
    assert span.parent is not None and span.parent.span_id == caller
    assert span.resource.attributes["service.name"] == SERVICE
    attributes = dict(span.attributes or {})
    assert attributes["pensieve.conversation_id"] == "c"
    assert attributes["pensieve.recomputed_tokens"] == 12
    assert attributes["pensieve.ranges"] == ("0-8", "16-20")


# ---- the real engine -------------------------------------------------------------------------

# 8 GPU blocks and 1 CPU slot of 16 tokens; a first turn takes 3 blocks, a second one 4
TIERS = dict(block_size=16, gpu_cache_tokens=128, cpu_cache_tokens=16, admission_reserve=0.0)
MESSAGES = ["What is the capital of France?", "Name three rivers that flow through it."]


class Sink:
    def __init__(self) -> None:
        self.reply: dict[str, Any] | None = None

    def delta(self, text: str, tokens: int) -> None:
        pass

    def done(self, reply: dict[str, Any]) -> None:
        self.reply = reply

    def error(self, error: ApiError) -> None:
        raise AssertionError(f"a turn failed: {error}")


@pytest.mark.slow
def test_admission_recomputes_the_ranges_the_planner_gave(
    smollm2: LoadedModel, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three conversations evict each other from tiny tiers; each next turn is planned over NATS
    before it starts, and the engine's admission then recomputes exactly the planned ranges.
    After a failed step every chunk is dropped: the next turn is planned all-recompute."""
    chat = ChatTokenizer(smollm2.tokenizer, smollm2.config.vocab_size)
    # the planner plans from each conversation's own chunks; found by content, a turn reuses
    # more than it foresaw (counted as `differed`), so sharing is off here
    options = EngineOptions(model="smollm2", max_batch_tokens=512, prefix_sharing=False, **TIERS)
    built = assemble(options, smollm2, chat)
    kv = built.engine.kv
    admitted: dict[str, Acquired] = {}  # conversation -> its turn's admission
    acquire = kv.acquire

    def spy(conv: ConversationKV, num_positions: int, now: float, *more: Any) -> Acquired:
        admitted[conv.conv_id] = acquire(conv, num_positions, now, *more)
        return admitted[conv.conv_id]

    monkeypatch.setattr(kv, "acquire", spy)
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        engine_id = store.engine_id()
        stream, published = KvEventStream(engine_id), []

        def publish(events: list[KvEvent]) -> None:
            published.append(encode_kv_events(stream.batch(events)))

        service = ChatService(built.engine, chat, 2048, store, writer, publish_kv=publish)

        def turn(body: dict[str, Any]) -> str:
            """Run one turn to its reply (committed); its conversation id."""
            reservation = service.reserve(parse_chat(orjson.dumps({"max_tokens": 2, **body})))
            sink = Sink()
            service.start(reservation, chat.render(reservation.messages), sink)
            while service.has_work():
                service.step()
            writer.flush()
            assert sink.reply is not None
            return str(sink.reply["conversation_id"])

        async def planned_turn(bus: Bus, conv_id: str) -> RecomputePlan:
            for body in published:  # what the server does after every step
                await bus.publish(subjects.kv_events(engine_id), body)
            published.clear()
            messages = [
                m
                for r in store.turns(conv_id)
                for m in (
                    {"role": "user", "content": r.user_message},
                    {"role": "assistant", "content": r.assistant_text},
                )
            ] + [{"role": "user", "content": MESSAGES[1]}]
            reuse = common_prefix(store.token_log(conv_id), chat.render(messages))
            plan = await plan_remote(bus, engine_id, conv_id, reuse, timeout_s=5.0)
            assert plan is not None and plan.known
            turn({"conversation_id": conv_id, "message": MESSAGES[1]})
            record = store.turns(conv_id)[-1]
            assert plan.ranges == admitted[conv_id].recompute_ranges
            assert plan.recomputed_tokens == record.cached_recomputed
            assert (plan.gpu_tokens, plan.cpu_tokens) == (record.cached_gpu, record.cached_cpu)
            return plan

        async def go() -> list[RecomputePlan]:
            async with RecomputePlannerActor(await Bus.connect(url), engine_id, store, 16):
                bus = await Bus.connect(url)
                try:
                    conv_ids = [turn({"message": MESSAGES[0]}) for _ in range(3)]
                    plans = [await planned_turn(bus, conv_id) for conv_id in conv_ids[:2]]
                    service.recover(RuntimeError("a failed step"))  # every chunk dropped
                    plans.append(await planned_turn(bus, conv_ids[0]))
                    return plans
                finally:
                    await bus.close()

        plans = asyncio.run(go())
    assert any(p.recomputed_tokens and p.gpu_tokens + p.cpu_tokens for p in plans[:2])
    assert plans[-1].ranges == ((0, plans[-1].num_positions),)
