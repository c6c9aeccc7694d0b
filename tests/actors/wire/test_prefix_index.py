"""The router's prefix index, fed hand-written KV event batches of two engines: which engine holds
how many leading chunks of a prompt, on which tier, as chunks are sealed, move, are shared,
unsealed, dropped and freed, and what it knows of an engine after a missed batch. Then over a
real nats-server from the real SmolLM2 engine: a subscriber finds the prompts' prefixes where the
engine holds them, and loses them as the engine drops their chunks."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import nats
import orjson

from pensieve.actors.config import Policy
from pensieve.actors.scheduler.kv.kv_events import KvEventStream
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire import subjects
from pensieve.actors.wire.chunk_keys import keys_of, namespace
from pensieve.actors.wire.messages import (
    KvEvent,
    KvEventKind,
    Tier,
    decode_kv_events,
    encode_kv_events,
)
from pensieve.actors.wire.prefix_index import PrefixIndex
from pensieve.models.loader import LoadedModel
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats
from tests.actors.scheduler.kv.test_kv_events import sealed_on_a_tier
from tests.ops.serving import serve_on_thread

SEED = namespace("smollm2")
PROMPT = list(range(100, 100 + 5 * 32))  # five full chunks of 32 tokens
KEYS = keys_of(SEED, PROMPT, 32)
OTHER = keys_of(SEED, PROMPT[:64] + [7] * 96, 32)  # the same first two chunks only

K = KvEventKind


def event(
    kind: KvEventKind,
    conv: str,
    i: int,
    gpu: int | None,
    cpu: int | None = None,
    keys: list[bytes] = KEYS,
    keyed: bool = True,
) -> KvEvent:
    """Chunk i of `conv` named by `keys` (or unsealed), as the engine would send it."""
    key = keys[i] if keyed else None
    parent = (keys[i - 1] if i else SEED) if keyed else None
    return KvEvent(kind, conv, i, gpu, cpu, key, parent)


def sealed(conv: str, num_chunks: int, keys: list[bytes] = KEYS) -> list[KvEvent]:
    """A turn that computed `num_chunks` full chunks on the GPU and sealed them."""
    stored = [event(K.STORED, conv, i, i, keyed=False) for i in range(num_chunks)]
    return stored + [event(K.SEALED, conv, i, i, keys=keys) for i in range(num_chunks)]


class Engines:
    """Each engine's stream of batches, through the wire format into one index."""

    def __init__(self, *engine_ids: str) -> None:
        self.streams = {engine_id: KvEventStream(engine_id) for engine_id in engine_ids}
        self.index = PrefixIndex()

    def publish(self, engine_id: str, events: list[KvEvent], lost: bool = False) -> None:
        batch = self.streams[engine_id].batch(events)
        if not lost:
            self.index.apply(decode_kv_events(encode_kv_events(batch)))

    def held(self, keys: list[bytes] = KEYS) -> dict[str, tuple[Tier, ...]]:
        return {e: m.tiers for e, m in self.index.match(keys).items()}


def test_a_sealed_prefix_is_found_where_it_is_and_as_far_as_it_goes() -> None:
    engines = Engines("e1")
    engines.publish("e1", [event(K.STORED, "a", i, i, keyed=False) for i in range(4)])
    assert engines.held() == {"e1": ()}  # computed, not sealed yet: nobody may find it
    engines.publish("e1", [event(K.SEALED, "a", i, i) for i in range(4)])
    assert engines.held() == {"e1": (Tier.GPU,) * 4}
    assert engines.held(OTHER) == {"e1": (Tier.GPU,) * 2}
    # a key names its whole prefix, in its namespace
    assert engines.held(keys_of(SEED, [0] * 32 + PROMPT[32:], 32)) == {"e1": ()}
    assert engines.held(keys_of(namespace("smollm2", "acme"), PROMPT, 32)) == {"e1": ()}
    # the first chunk goes to the CPU, the second is dropped: the prefix stops there
    engines.publish("e1", [event(K.SWAPPED_OUT, "a", 0, None, 3), event(K.DROPPED, "a", 1, None)])
    assert engines.held() == {"e1": (Tier.CPU,)}
    assert engines.index.held("e1") == {KEYS[0]: Tier.CPU, KEYS[2]: Tier.GPU, KEYS[3]: Tier.GPU}
    engines.publish("e1", [event(K.RECOMPUTED, "a", 1, 1, keyed=False)])  # its own again
    engines.publish("e1", [event(K.SEALED, "a", 1, 1), event(K.SWAPPED_IN, "a", 0, 0, 3)])
    assert engines.held() == {"e1": (Tier.GPU,) * 4}


def test_a_shared_chunk_counts_until_its_last_user_frees_it() -> None:
    engines = Engines("e1")
    engines.publish("e1", sealed("a", 3))
    # b found a's first two chunks by content, and computed a third of its own
    engines.publish("e1", [event(K.STORED, "b", i, i) for i in range(2)])
    engines.publish("e1", [event(K.STORED, "b", 2, 5, keyed=False)])
    engines.publish("e1", [event(K.SEALED, "b", 2, 5, keys=OTHER)])
    engines.publish("e1", [event(K.REMOVED, "a", 0, None, keyed=False)])  # a is deleted
    assert engines.held() == {"e1": (Tier.GPU,) * 2}
    assert engines.held(OTHER) == {"e1": (Tier.GPU,) * 3}
    engines.publish("e1", [event(K.REMOVED, "b", 1, None, keyed=False)])  # b cut after chunk 0
    assert engines.held(OTHER) == {"e1": (Tier.GPU,)}
    engines.publish("e1", [event(K.UNSEALED, "b", 0, 0, keyed=False)])  # and into chunk 0
    assert engines.held(OTHER) == {"e1": ()} and engines.index.held("e1") == {}


def test_two_engines_are_told_apart_and_the_best_holds_the_longest_prefix() -> None:
    engines = Engines("e1", "e2")
    engines.publish("e1", sealed("a", 2))
    engines.publish("e2", sealed("c", 4))
    engines.publish("e2", [event(K.SWAPPED_OUT, "c", i, None, i) for i in range(3)])
    assert engines.held() == {"e1": (Tier.GPU,) * 2, "e2": (Tier.CPU,) * 3 + (Tier.GPU,)}
    best = engines.index.best(KEYS)
    assert (best.engine_id, best.num_chunks, best.num_gpu_chunks) == ("e2", 4, 1)
    assert engines.index.best(KEYS[:2]).engine_id == "e1"  # as long, more of it on the GPU
    engines.index.forget("e2")
    assert engines.held() == {"e1": (Tier.GPU,) * 2}
    assert engines.index.best(KEYS, among=["e3"]).num_chunks == 0


def test_a_missed_batch_marks_the_engine_stale_until_it_starts_afresh() -> None:
    engines = Engines("e1", "e2")
    engines.publish("e1", sealed("a", 3))
    engines.publish("e2", sealed("c", 3))
    engines.publish("e1", [event(K.DROPPED, "a", 0, None)], lost=True)
    engines.publish("e1", sealed("b", 1, OTHER))  # e1's next batch after the lost one
    # a's chunks may have moved unseen: forgotten; what came after the gap is known
    assert engines.index.stale() == {"e1"}
    assert engines.held() == {"e1": (Tier.GPU,), "e2": (Tier.GPU,) * 3}
    assert engines.index.match(KEYS)["e1"].stale and not engines.index.match(KEYS)["e2"].stale
    engines.streams["e1"] = KvEventStream("e1")  # the engine restarted: batch 1, empty tiers
    engines.publish("e1", sealed("a", 2))
    assert engines.index.stale() == set()
    assert engines.held() == {"e1": (Tier.GPU,) * 2, "e2": (Tier.GPU,) * 3}


def test_an_engine_first_heard_of_after_its_first_batch_is_stale() -> None:
    engines = Engines("e1")
    engines.publish("e1", sealed("a", 1), lost=True)  # before the router subscribed
    engines.publish("e1", sealed("b", 2))
    assert engines.index.stale() == {"e1"} and engines.held() == {"e1": (Tier.GPU,) * 2}


def test_an_event_without_keys_decodes_as_before() -> None:
    """A batch as an engine without chunk keys wrote it reads with none."""
    old = (
        b'{"v":1,"engine_id":"e","seq":1,"time":0.5,"events":[{"kind":"stored",'
        b'"conversation_id":"c","index":0,"gpu_block":3,"cpu_slot":null}]}'
    )
    (decoded,) = decode_kv_events(old).events
    assert decoded == KvEvent(K.STORED, "c", 0, 3, None) and decoded.key is None


# ---- over NATS, from a real engine -----------------------------------------------------------

BLOCK = 32
# 20 GPU blocks and no CPU tier: the third prompt below needs blocks the first two hold
TINY = dict(block_size=BLOCK, gpu_cache_tokens=20 * BLOCK, admission_reserve=0.0)
NUMBERS = ", ".join(f"number {i}" for i in range(55))
FIRST = f"Here is a list: {NUMBERS}."  # 300 tokens with the chat template
LETTERS = ", ".join(f"letter {c}" for c in "abcdefghij")
SECOND = f"Here is a list: {NUMBERS[: len(NUMBERS) // 2]}, {LETTERS}"  # the same first half
THIRD = "Another topic entirely: " + ", ".join(f"word {i}" for i in range(60)) + "."


class Router:
    """A router's view over NATS: every KV event batch of the engines into a prefix index."""

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.index = PrefixIndex()

    async def follow(self) -> None:
        self.sub = await self.nc.subscribe("pensieve.v1.engine.*.kv")
        await self.nc.flush()

    async def chat(self, message: str) -> None:
        body = {"message": message, "max_tokens": 1}
        reply = await self.nc.request(subjects.CHAT, orjson.dumps(body), timeout=120)
        assert "conversation_id" in orjson.loads(reply.data), reply.data
        await self.nc.request(subjects.STATS, b"{}", timeout=10)  # every batch is out now
        with contextlib.suppress(nats.errors.TimeoutError):
            while True:
                self.index.apply(decode_kv_events((await self.sub.next_msg(timeout=0.5)).data))


def test_a_router_finds_the_engine_holding_a_prompts_prefix_over_nats(
    smollm2: LoadedModel, tmp_path: Path
) -> None:
    chat = ChatTokenizer(smollm2.tokenizer, smollm2.config.vocab_size)
    options = EngineOptions(model="smollm2", policy=Policy.GPU_ONLY, **TINY)
    built = assemble(options, smollm2, chat)
    seed = namespace(built.engine.model_id)  # the model's, no tenant, no salt

    def keys(message: str) -> list[bytes]:
        return keys_of(seed, chat.render([{"role": "user", "content": message}]), BLOCK)

    first, second, third = keys(FIRST), keys(SECOND), keys(THIRD)
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert len(first) >= 9 and 2 <= common < len(first) - 2

    async def converse(url: str, engine_id: str) -> None:
        nc = await nats.connect(url)
        router = Router(nc)
        await router.follow()
        await router.chat(FIRST)
        found = router.index.match(first)[engine_id]
        assert found.tiers == (Tier.GPU,) * len(first)  # every full chunk of the prompt
        assert router.index.match(second)[engine_id].num_chunks == common
        assert router.index.best(second).engine_id == engine_id
        await router.chat(SECOND)
        assert router.index.match(second)[engine_id].num_chunks == len(second)
        assert router.index.match(first)[engine_id].num_chunks == len(first)
        await router.chat(THIRD)  # evicts (drops) chunks of the first two
        assert router.index.match(third)[engine_id].num_chunks == len(third)
        assert router.index.match(first)[engine_id].num_chunks < len(first)
        assert router.index.held(engine_id) == sealed_on_a_tier(built.engine.kv)
        assert router.index.stale() == set()
        await nc.close()

    with (
        EmbeddedNats() as server,
        serve_on_thread(built, tmp_path, server.url) as (engine_id, _),
    ):
        asyncio.run(converse(server.url, engine_id))
