"""The KV event plane on the real SmolLM2 with tiny tiers, so chunks are stored, swapped out and
in, reclaimed, dropped and recomputed: a subscriber that applies every batch rebuilds the engine's
own tier map after every step, and the LMDB spill index equals the CPU tier once the store writer
has caught up. Over a real nats-server, the published batches do the same and come numbered
1, 2, 3, ..., and an executor actor on its own connection keeps the spill index from them. The
cache manager's property tests (test_kv_manager.py) check the same two maps after every random
operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from pensieve.actors.config import CacheConfig, Policy, StepChannel
from pensieve.actors.executor.spill_keeper import SpillIndex, SpillKeeper
from pensieve.actors.planner.tier_map import SequenceGap, TierMap
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.scheduler.kv.kv_events import KvEventStream
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire import subjects
from pensieve.actors.wire.messages import (
    KvEvent,
    KvEventBatch,
    KvEventKind,
    MessageError,
    Tier,
    decode_kv_events,
    encode_kv_events,
)
from pensieve.actors.wire.prefix_index import PrefixIndex
from pensieve.actors.wire.request_parsing import parse_chat
from pensieve.actors.wire.schemas import ApiError
from pensieve.models.loader import LoadedModel
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import Built, assemble
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.store import ConversationStore, StoreWriter
from pensieve.store.spill_index import SpillIndexWriter
from tests.actors.scheduler.kv.test_kv_manager import snapshot
from tests.ops.serving import serve_on_thread

# 8 GPU blocks and 4 CPU slots of 16 tokens; a first turn's prompt takes 3 blocks
TIERS = dict(block_size=16, gpu_cache_tokens=128, cpu_cache_tokens=64, admission_reserve=0.0)
MESSAGES = ["What is the capital of France?", "Name three rivers that flow through it."]


def engine(smollm2: LoadedModel, chat: ChatTokenizer) -> Built:
    return assemble(EngineOptions(model="smollm2", max_batch_tokens=512, **TIERS), smollm2, chat)


class Sink:
    def __init__(self) -> None:
        self.reply: dict[str, Any] | None = None

    def delta(self, text: str, tokens: int) -> None:
        pass

    def done(self, reply: dict[str, Any]) -> None:
        self.reply = reply

    def error(self, error: ApiError) -> None:
        raise AssertionError(f"a turn failed: {error}")


class Subscriber:
    """What a subscriber on the KV subject does, without the bus: every batch goes through the
    wire format into a TierMap."""

    def __init__(self) -> None:
        self.stream = KvEventStream("e0")
        self.tier_map = TierMap()
        self.router = PrefixIndex()
        self.kinds: set[KvEventKind] = set()

    def publish(self, events: list[KvEvent]) -> None:
        batch = decode_kv_events(encode_kv_events(self.stream.batch(events)))
        self.tier_map.apply(batch)
        self.router.apply(batch)
        self.kinds.update(event.kind for event in batch.events)


def sealed_on_a_tier(kv: KVCacheManager) -> dict[bytes, Tier]:
    """The content keys the cache manager would find a prefix by, and where their chunks are."""
    sealed = kv.index.by_key.items()
    return {key: chunk.tier for key, chunk in sealed if chunk.tier is not Tier.DROPPED}


def turns(service: ChatService, bodies: list[dict[str, Any]], subscriber: Subscriber) -> list[str]:
    """Start the turns together and step until all are answered, checking the rebuilt tier map
    against the engine's after every step; their conversation ids."""
    sinks = []
    for body in bodies:
        reservation = service.reserve(parse_chat(orjson.dumps({"max_tokens": 4, **body})))
        sinks.append(Sink())
        service.start(reservation, service.chat.render(reservation.messages), sinks[-1])
    while service.has_work():
        service.step()
        assert subscriber.tier_map.snapshot() == snapshot(service.engine.kv)
        assert subscriber.router.held("e0") == sealed_on_a_tier(service.engine.kv)
    service.writer.flush()  # the replies are sent once their turns are committed
    assert all(sink.reply is not None for sink in sinks)
    return [sink.reply["conversation_id"] for sink in sinks]  # type: ignore[index]


def cpu_tier(kv: KVCacheManager, conv_id: str) -> dict[int, int]:
    conv = kv.get(conv_id)
    chunks = conv.chunks if conv is not None else []
    return {i: chunk.cpu_slot for i, chunk in enumerate(chunks) if chunk.cpu_slot is not None}


def test_a_subscriber_and_the_spill_index_follow_the_engine_through_every_tier(
    smollm2, chat, tmp_path: Path
) -> None:
    built = engine(smollm2, chat)
    subscriber = Subscriber()
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        service = ChatService(
            built.engine, chat, 2048, store, writer, publish_kv=subscriber.publish
        )
        built.engine.follow_kv_events(SpillKeeper(store, writer).apply)  # as `pensieve serve`
        kv = built.engine.kv
        # four at once, twice: turns wait, evict each other and come back to moved histories
        # (they share the chat template's opening chunks, and differ after them)
        firsts = [{"message": f"{i}. {MESSAGES[0]}"} for i in range(4)]
        conv_ids = turns(service, firsts, subscriber)
        follow = [{"conversation_id": conv_id, "message": MESSAGES[1]} for conv_id in conv_ids]
        turns(service, follow, subscriber)
        writer.flush()
        assert {c: store.spills(c) for c in conv_ids} == {c: cpu_tier(kv, c) for c in conv_ids}
        assert any(cpu_tier(kv, c) for c in conv_ids), "nothing is left in the CPU tier"
        # a client that resends the chat edited: the history is cut inside a sealed chunk
        edited = [{"role": "user", "content": "2. What is the capital of Spain?"}]
        turns(service, [{"conversation_id": conv_ids[2], "messages": edited}], subscriber)
        service.delete(conv_ids[0]).result()
        service.recover(RuntimeError("a failed step"))  # every chunk dropped, as after a restart
        assert subscriber.tier_map.snapshot() == snapshot(kv)
        turns(service, [{"conversation_id": conv_ids[1], "message": "Thanks!"}], subscriber)
        writer.flush()
        assert {c: store.spills(c) for c in conv_ids} == {c: cpu_tier(kv, c) for c in conv_ids}
        kv.check_invariants()
    assert subscriber.kinds == set(KvEventKind), "the run did not take every path"


def test_a_batch_out_of_sequence_is_refused_and_a_fresh_engine_starts_the_map_over() -> None:
    stream, tier_map = KvEventStream("e1"), TierMap()
    tier_map.apply(stream.batch([KvEvent(KvEventKind.STORED, "c", 0, 3, None)]))
    stream.batch([])  # lost on the way
    with pytest.raises(SequenceGap, match="1 missed"):
        tier_map.apply(stream.batch([KvEvent(KvEventKind.SWAPPED_OUT, "c", 0, None, 1)]))
    assert tier_map.locations("c") == ((3, None),) and tier_map.last_seq == 1
    restarted = KvEventStream("e1")
    tier_map.apply(restarted.batch([KvEvent(KvEventKind.STORED, "d", 0, 0, None)]))
    assert tier_map.snapshot() == {"d": ((0, None),)}


def test_a_batch_decodes_as_sent_and_a_malformed_one_is_refused() -> None:
    batch = KvEventBatch("e", 1, 0.5, (KvEvent(KvEventKind.RECLAIMED, "c", 2, None, 5),))
    assert decode_kv_events(encode_kv_events(batch)) == batch
    good = orjson.loads(encode_kv_events(batch))
    event = good["events"][0]
    assert event == {
        "kind": "reclaimed",
        "conversation_id": "c",
        "index": 2,
        "gpu_block": None,
        "cpu_slot": 5,
        "key": None,
        "parent": None,
    }
    bad_events = (
        {**event, "kind": "moved"},
        {**event, "index": -1},
        {**event, "gpu_block": "7"},
        {**event, "key": "not base64!"},
    )
    for bad in bad_events:
        with pytest.raises(MessageError):
            decode_kv_events(orjson.dumps({**good, "events": [bad]}))
    for fields in ({"seq": 0}, {"v": 2}, {"events": None}):
        with pytest.raises(MessageError):
            decode_kv_events(orjson.dumps({**good, **fields}))


def cost(context: int) -> float:
    return 1.0 + context / 100


class Follower:
    """A cache manager with a tier map and a spill index that follow its events."""

    def __init__(self, num_gpu: int, num_cpu: int) -> None:
        config = CacheConfig(4, num_gpu, num_cpu, Policy.PENSIEVE, swap_out_threshold=0.99)
        self.kv = KVCacheManager(config, cost)
        self.kv.take_events()
        self.spilled: dict[tuple[str, int], int | None] = {}  # the spill index's writes
        self.spills = SpillIndex(self.spilled.update)
        self.stream, self.tier_map = KvEventStream("e"), TierMap()

    def turn(self, conv_id: str, num_positions: int, now: float) -> None:
        conv = self.kv.conversation(conv_id, now)
        self.kv.acquire(conv, num_positions, now)
        conv.num_positions = num_positions
        self.kv.release(conv, now + 1.0)

    def check(self) -> list[KvEventKind]:
        """The events since the last check, once both maps are found equal to the manager's."""
        kv = self.kv
        kv.check_invariants()
        events = kv.take_events()
        self.tier_map.apply(self.stream.batch(events))
        self.spills.apply(events)
        assert self.tier_map.snapshot() == snapshot(kv)
        in_index = {key: slot for key, slot in self.spilled.items() if slot is not None}
        assert in_index == {(c, i): s for c in kv.conversations for i, s in cpu_tier(kv, c).items()}
        return [event.kind for event in events]


def test_a_cpu_copy_given_up_leaves_the_map_and_the_index() -> None:
    """The paths random operations rarely reach: a swap-out withdrawn in the step that decided
    it, a partial chunk's stale copy, and a backed copy whose slot another chunk needs."""
    f = Follower(num_gpu=4, num_cpu=2)
    f.turn("a", 6, 0.0)  # a full chunk and a partial one
    f.kv.take_orders()
    f.kv.swap_out_ahead(2.0)  # both go out: copies ordered, not yet issued
    assert f.check() == [KvEventKind.STORED] * 2 + [KvEventKind.SWAPPED_OUT] * 2
    f.turn("a", 7, 3.0)  # back before the copies went out: they are withdrawn
    assert f.check() == [KvEventKind.CPU_FREED] * 2
    f.kv.swap_out_ahead(5.0)
    f.kv.take_orders()  # issued now
    f.turn("a", 7, 6.0)  # back while its blocks wait for reuse: the partial copy is stale
    assert f.check() == [KvEventKind.SWAPPED_OUT] * 2 + [KvEventKind.CPU_FREED]

    f = Follower(num_gpu=4, num_cpu=3)
    f.turn("b", 8, 0.0)
    f.turn("a", 4, 2.0)
    f.kv.swap_out_ahead(4.0)  # b's two chunks and a's one
    f.kv.take_orders()
    f.turn("c", 8, 5.0)  # a free block and b's first reclaimed
    assert f.check()[-3:] == [KvEventKind.STORED, KvEventKind.RECLAIMED, KvEventKind.STORED]
    f.turn("a", 4, 7.0)  # back on the GPU, its CPU copy kept (backed)
    assert f.check() == []
    f.kv.swap_out_ahead(9.0)  # c's first chunk needs a slot: a's backed copy gives up its own
    assert f.check()[0] == KvEventKind.CPU_FREED


def test_the_spill_writer_coalesces_changes_into_one_waiting_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        written: list[tuple[list, list]] = []
        update = store.update_spills

        def record(puts: list, removes: list) -> None:
            written.append((puts, removes))
            update(puts, removes)

        monkeypatch.setattr(store, "update_spills", record)
        spills = SpillIndexWriter(store, writer)
        gate = threading.Event()
        writer.submit(gate.wait)  # the writer is busy: changes wait in one queued write
        spills.update({("c", 0): 4, ("c", 1): 5})
        spills.update({("c", 1): None, ("d", 0): 6})
        gate.set()
        writer.flush()
        assert written == [([("c", 0, 4), ("d", 0, 6)], [("c", 1)])]
        assert store.spills("c") == {0: 4} and store.spills("d") == {0: 6}
        spills.update({("c", 0): None})
        writer.flush()
        assert len(written) == 2 and store.spills("c") == {}


async def converse(url: str, engine_id: str) -> list[KvEventBatch]:
    """Four conversations of two turns over NATS, the turns of a round at once; the KV event
    batches published meanwhile."""
    nc = await nats.connect(url)
    sub = await nc.subscribe(subjects.kv_events(engine_id))
    await nc.flush()

    async def ask(subject: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await nc.request(subject, orjson.dumps(body), timeout=120)
        return orjson.loads(reply.data)

    first = [ask(subjects.CHAT, {"message": MESSAGES[0], "max_tokens": 4}) for _ in "abcd"]
    conv_ids = [reply["conversation_id"] for reply in await asyncio.gather(*first)]
    await asyncio.gather(
        *[
            ask(subjects.CHAT, {"conversation_id": c, "message": MESSAGES[1], "max_tokens": 4})
            for c in conv_ids
        ]
    )
    await ask(subjects.STATS, {})  # runs between steps: every batch before it is out
    batches = []
    with contextlib.suppress(nats.errors.TimeoutError):
        while True:
            batches.append(decode_kv_events((await sub.next_msg(timeout=1.0)).data))
    await nc.close()
    return batches


def test_a_nats_subscriber_rebuilds_the_engines_tier_map(smollm2, chat, tmp_path: Path) -> None:
    built = engine(smollm2, chat)
    with (
        EmbeddedNats() as server,
        serve_on_thread(built, tmp_path, server.url) as (engine_id, service),
    ):
        batches = asyncio.run(converse(server.url, engine_id))
        tier_map = TierMap()
        for batch in batches:
            tier_map.apply(batch)
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
        assert {b.engine_id for b in batches} == {engine_id}
        kv = built.engine.kv
        assert tier_map.snapshot() == snapshot(kv) and any(
            cpu_tier(kv, c) for c in kv.conversations
        )
        service.writer.flush()
        assert {c: service.store.spills(c) for c in kv.conversations} == {
            c: cpu_tier(kv, c) for c in kv.conversations
        }


def test_the_executor_actor_keeps_the_spill_index_from_the_kv_events(
    smollm2, chat, tmp_path: Path
) -> None:
    """With the model behind an executor actor on a NATS connection of its own, the scheduler
    keeps no spill index: the executor's swap manager writes it from the KV event plane. It
    starts empty (an executor that starts has an empty CPU tier) and equals the CPU tier once
    the executor has applied the batches."""
    with ConversationStore(tmp_path) as store:  # what an earlier executor left
        store.put_spills([("c-0123abcd-0000000000000000", 0, 1)])
    built = engine(smollm2, chat)
    with (
        EmbeddedNats() as server,
        serve_on_thread(built, tmp_path, server.url, step_channel=StepChannel.NATS) as (
            engine_id,
            service,
        ),
    ):
        assert service.store.spills("c-0123abcd-0000000000000000") == {}
        asyncio.run(converse(server.url, engine_id))
        kv = built.engine.kv
        cpu = {c: cpu_tier(kv, c) for c in kv.conversations}
        assert any(cpu.values()), "nothing is left in the CPU tier"
        deadline = time.monotonic() + 10  # applied on the executor's writer thread
        while {c: service.store.spills(c) for c in cpu} != cpu and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {c: service.store.spills(c) for c in cpu} == cpu


def test_the_spill_index_starts_over_where_the_events_do(tmp_path: Path) -> None:
    """Batch 1 (a scheduler that started afresh) and a gap in the numbering empty the index;
    the batches that follow build it again."""
    a, b = "c-0123abcd-000000000000000a", "c-0123abcd-000000000000000b"

    def stored(index: int, slot: int | None, conv_id: str = a) -> KvEvent:
        kind = KvEventKind.SWAPPED_OUT if slot is not None else KvEventKind.CPU_FREED
        return KvEvent(kind, conv_id, index, None, slot)

    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        store.put_spills([(b, 0, 7)])
        keeper = SpillKeeper(store, writer)
        stream = KvEventStream("e")
        keeper.apply_batch(stream.batch([stored(0, 1), stored(1, 2)]))
        keeper.apply_batch(stream.batch([stored(1, None)]))
        writer.flush()
        assert store.spills(a) == {0: 1} and store.spills(b) == {}
        stream.batch([])  # lost on the way
        keeper.apply_batch(stream.batch([stored(0, 3, b)]))
        writer.flush()
        assert store.spills(a) == {} and store.spills(b) == {0: 3}
        keeper.apply_batch(KvEventStream("e").batch([stored(2, 4)]))  # a fresh scheduler
        writer.flush()
        assert store.spills(a) == {2: 4} and store.spills(b) == {}
