"""A conversation's lifecycle (the real SmolLM2, a real LMDB): a final turn frees its KV at once
and ends it for good, also across a restart; the sweeper deletes conversations idle past their
TTL (stateless-made and ended ones sooner) but never one with a turn in progress, and keeps the
store bounded; and the whole path over a real nats-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from pensieve.actors.config import ExpiryConfig
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.scheduler.engine_thread import EngineThread
from pensieve.actors.scheduler.sweeper import Sweeper
from pensieve.actors.wire.request_parsing import parse_chat
from pensieve.actors.wire.schemas import ApiError
from pensieve.actors.wire.subjects import CHAT, CONVERSATIONS_GET
from pensieve.ops.context import Context, Nats, ServeOptions
from pensieve.ops.deploy import deployment, serve_plan
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.store import ConversationStore, StoreWriter
from tests.ops.test_chat_service import turn
from tests.ops.test_serve import ask, chat

pytestmark = pytest.mark.slow

HOUR, WEEK = 3600.0, 7 * 24 * 3600.0
EXPIRY = ExpiryConfig(conversation_ttl_s=WEEK, stateless_ttl_s=HOUR)
STATELESS = [{"role": "user", "content": "What is the capital of France?"}]


def new_service(
    smollm2, smollm2_chat, store: ConversationStore, writer: StoreWriter
) -> ChatService:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    return ChatService(built.engine, built.chat, 4096, store, writer)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ConversationStore]:
    with ConversationStore(tmp_path) as opened:
        yield opened


@pytest.fixture
def service(smollm2, smollm2_chat, store) -> Iterator[ChatService]:
    with StoreWriter() as writer:
        yield new_service(smollm2, smollm2_chat, store, writer)


def reply(service: ChatService, **body: Any) -> dict[str, Any]:
    sink = turn(service, max_tokens=2, **body)
    assert sink.reply is not None, sink.refused
    return sink.reply


def refusal(service: ChatService, **body: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        turn(service, max_tokens=2, **body)
    return refused.value


def test_a_final_turn_frees_the_kv_at_once_and_ends_the_conversation(
    smollm2, smollm2_chat, store, service
) -> None:
    conv_id = reply(service, message="Hello!")["conversation_id"]
    assert service.engine.kv.get(conv_id) is not None  # an open conversation keeps its KV
    last = reply(service, conversation_id=conv_id, message="Bye!", final=True)
    assert last["final"] is True and last["turn"] == 1
    assert service.engine.kv.get(conv_id) is None
    refused = refusal(service, conversation_id=conv_id, message="One more thing")
    assert refused.code == "invalid_request" and "has ended" in refused.message
    got = service.get(conv_id)
    assert got.ended is True and [t.message for t in got.turns] == ["Hello!", "Bye!"]
    with StoreWriter() as writer:  # a restarted server refuses it too
        restarted = new_service(smollm2, smollm2_chat, store, writer)
        refused = refusal(restarted, conversation_id=conv_id, message="One more thing")
        assert refused.code == "invalid_request" and "has ended" in refused.message
        assert restarted.engine.kv.get(conv_id) is None and restarted.get(conv_id).ended


def test_final_must_be_true_or_false() -> None:
    for wrong in ("yes", 1, None, [True]):
        with pytest.raises(ApiError) as refused:
            parse_chat(orjson.dumps({"message": "hi", "final": wrong}))
        assert refused.value.code == "invalid_request" and "'final'" in refused.value.message
    assert parse_chat(b'{"message": "hi", "final": true}').final
    assert not parse_chat(b'{"message": "hi"}').final


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_sweeper_deletes_idle_conversations_by_their_ttl_but_not_a_busy_one(
    service,
) -> None:
    stateful = reply(service, message="Hello!")["conversation_id"]
    stateless = reply(service, messages=STATELESS)["conversation_id"]
    ended = reply(service, message="Bye!", final=True)["conversation_id"]
    busy = reply(service, message="Hi again")["conversation_id"]
    start = time.time()  # after every turn so far
    engine = EngineThread(service)
    try:
        clock = Clock(start + 10)
        sweeper = Sweeper(engine, EXPIRY, clock)
        request = parse_chat(orjson.dumps({"conversation_id": busy, "message": "and?"}))
        reservation = engine.call(service.reserve, request).result(30)

        def alive() -> set[str]:
            return set(service.store.list_conversations())

        assert asyncio.run(sweeper.sweep()) == 0
        assert alive() == {stateful, stateless, ended, busy}
        clock.now = start + HOUR + 1  # past the stateless TTL only: the stateless and the ended
        assert asyncio.run(sweeper.sweep()) == 2
        assert alive() == {stateful, busy}
        clock.now = start + WEEK + 1
        assert asyncio.run(sweeper.sweep()) == 1  # the busy one stays
        assert alive() == {busy}
        assert service.engine.kv.get(stateful) is None and stateful not in service.conversations
        engine.call(service.release, reservation).result(30)
        assert asyncio.run(sweeper.sweep()) == 1 and alive() == set()
    finally:
        engine.stop()


def test_stateless_conversations_that_expire_keep_the_store_bounded(service) -> None:
    used = []
    clock = Clock(0.0)
    for cycle in range(6):
        for i in range(4):  # a stateless client: a new conversation for every request
            content = f"Tell me about the number {cycle * 10 + i}. " * 20
            reply(service, messages=[{"role": "user", "content": content}])
        engine = EngineThread(service)
        try:
            clock.now = time.time() + HOUR + 1  # every turn so far is past the TTL
            assert asyncio.run(Sweeper(engine, EXPIRY, clock).sweep()) == 4
        finally:
            engine.stop()
        used.append(service.store.used_bytes())
    assert service.store.list_conversations() == [] and not service.conversations
    assert used[-1] - used[2] < used[0] / 4, used  # freed pages are reused


def test_over_nats_a_final_conversation_is_refused_and_idle_ones_expire(
    smollm2, smollm2_chat, tmp_path: Path
) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    expiry = ExpiryConfig(conversation_ttl_s=1.0, stateless_ttl_s=1.0)  # swept every second
    stop, ready, failed = threading.Event(), threading.Event(), []

    async def main(url: str) -> None:
        with ConversationStore(tmp_path) as store:
            options = ServeOptions(tmp_path, expiry=expiry)
            context = Context(Nats(url), store, built.options, options, built=built)
            async with deployment(context, serve_plan(options)):
                ready.set()
                await asyncio.to_thread(stop.wait)

    with EmbeddedNats() as nats_server:
        url = nats_server.url
        thread = threading.Thread(target=_run, args=(main(url), ready, failed), daemon=True)
        thread.start()
        try:
            assert ready.wait(120) and not failed, failed
            first = chat(url, message="Hello!", max_tokens=2, final=True)
            conv_id = first["conversation_id"]
            assert first["final"] is True
            more = {"conversation_id": conv_id, "message": "More?", "max_tokens": 2}
            replies, _ = ask(url, CHAT, more)
            assert replies[-1]["error"]["code"] == "invalid_request"
            assert "has ended" in replies[-1]["error"]["message"]
            for _ in range(100):
                replies, _ = ask(url, CONVERSATIONS_GET, {"conversation_id": conv_id})
                if "error" in replies[-1]:
                    break
                assert replies[-1]["ended"] is True
                threading.Event().wait(0.1)
            assert replies[-1]["error"]["code"] == "not_found"  # expired and swept
        finally:
            stop.set()
            thread.join(60)
    assert not failed, failed


def _run(coroutine: Any, ready: threading.Event, failed: list[BaseException]) -> None:
    try:
        asyncio.run(coroutine)
    except BaseException as error:
        failed.append(error)
        ready.set()
