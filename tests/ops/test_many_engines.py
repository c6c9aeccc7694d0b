"""Two engines (`pensieve serve --turn-log jetstream`, each a process of its own, the real
SmolLM2 on the CPU) on a real 3-node nats-server cluster with JetStream on loopback ports.

Clients send each turn until it is answered (as in test_actor_processes.py: a turn refused
`unavailable`, or unanswered, is sent again once its stored state is checked), each saying the
turn number it expects, so that a copy sent again is never committed twice. Under load:

- kill -9 of an engine: its conversations go on at the other engine within 5 s of the kill
  (the lease's TTL, 2 s, then one turn's recompute), with the greedy tokens of an uninterrupted
  run, and no acknowledged turn is lost; the old owner started again serves none of them (its
  store never gets their later turns);
- kill -9 of the NATS node an engine is connected to: no acknowledged turn is lost;
- SIGTERM of an engine: it lets its conversations go as it exits, and they go on at the other;
- a turn sent again to the engine that adopted its conversation after the turn was committed
  is refused `conflict`: the adopter counts the turns of the replicated log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from pensieve.actors.wire import subjects
from pensieve.store import ConversationStore
from tests.ops.nats_cluster import EngineProcess, NatsCluster
from tests.ops.serving import stateless_references

pytestmark = pytest.mark.slow

CHATS = [
    ["What is the capital of France?", "And of Italy?", "Which is bigger?", "Name a river."],
    ["Give me a word that rhymes with cat.", "Another one?", "Use both.", "Make it a question."],
    ["How many legs does a spider have?", "And an ant?", "Which has more?", "Name an insect."],
]
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 2.0  # a turn takes well under a second here; silence means a lost engine
FAILOVER_S = 5.0


@pytest.fixture(scope="module")
def reference(smollm2, smollm2_chat, tmp_path_factory) -> list[list[list[int]]]:
    folder = tmp_path_factory.mktemp("chat")
    return stateless_references(smollm2, smollm2_chat, CHATS, MAX_TOKENS, folder)


@dataclass
class Conversation:
    messages: list[str]
    first_engine: str  # the engine its first turn is sent to
    conv_id: str | None = None
    replies: list[dict[str, Any]] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)


async def send_until_answered(client: Any, conv: Conversation, message: str) -> dict[str, Any]:
    """The turn's reply, sending it again while it is refused `unavailable` or unanswered. It
    says the turn number it expects, so a copy that reaches the engine after another was
    committed (or while another runs) is refused `conflict`: then, as after silence, the
    client reads the stored turn, and sends the turn again only if none is stored."""
    body: dict[str, Any] = {"message": message, "max_tokens": MAX_TOKENS}
    subject = subjects.engine_subject(conv.first_engine, subjects.CHAT)
    if conv.conv_id is not None:
        body.update(conversation_id=conv.conv_id, turn=len(conv.replies))
        subject = subjects.CHAT  # any engine's ingress: it routes by owner
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            msg = await client.request(subject, orjson.dumps(body), timeout=REQUEST_TIMEOUT_S)
            reply = dict(orjson.loads(msg.data))
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            reply = {"error": {"code": "unavailable"}}
            stored = await stored_turn(client, conv)
            if stored is not None:
                return stored
        code = reply.get("error", {}).get("code")
        if code == "conflict":
            stored = await stored_turn(client, conv)
            if stored is not None:
                return stored
        elif code != "unavailable":
            return reply
        await asyncio.sleep(0.2)
    raise AssertionError(f"{message!r} was never answered")


async def stored_turn(client: Any, conv: Conversation) -> dict[str, Any] | None:
    """The conversation's next turn if the log has it (a turn committed whose reply was lost)."""
    if conv.conv_id is None:
        return None
    body = orjson.dumps({"conversation_id": conv.conv_id})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            msg = await client.request(subjects.CONVERSATIONS_GET, body, timeout=REQUEST_TIMEOUT_S)
            got = orjson.loads(msg.data)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            got = {"error": "silence"}
        if "error" in got or got["busy"]:
            await asyncio.sleep(0.2)
        elif got["num_turns"] > len(conv.replies):
            turn = got["turns"][len(conv.replies)]
            return {"conversation_id": conv.conv_id, "turn": turn["turn"], "text": turn["text"]}
        else:
            return None
    raise AssertionError(f"{conv.conv_id} could not be read")


async def talk(urls: list[str], conv: Conversation, acknowledged: list[int]) -> None:
    client = await nats.connect(urls, max_reconnect_attempts=-1)
    try:
        for message in conv.messages:
            reply = await send_until_answered(client, conv, message)
            assert "error" not in reply, reply
            conv.conv_id = reply["conversation_id"]
            conv.replies.append(reply)
            conv.answered_at.append(time.monotonic())
            acknowledged.append(1)
    finally:
        await client.close()


async def after(
    acknowledged: list[int],
    count: int,
    talks: list[asyncio.Future[None]],
    also: Callable[[], bool] = lambda: True,
) -> None:
    """Until `count` turns are acknowledged (and `also()`); a conversation that failed fails it
    at once, rather than leave it waiting for turns that will never come."""
    while len(acknowledged) < count or not also():
        for talk in talks:
            if talk.done():
                talk.result()  # its failure, raised here
        await asyncio.sleep(0.05)


async def stored_turns(urls: list[str], conv_id: str) -> list[dict[str, Any]]:
    client = await nats.connect(urls)
    try:
        body = orjson.dumps({"conversation_id": conv_id})
        msg = await client.request(subjects.CONVERSATIONS_GET, body, timeout=30)
    finally:
        await client.close()
    got = orjson.loads(msg.data)
    assert "error" not in got, got
    return list(got["turns"])


def check(conversations: list[Conversation], reference, stored: list[list[dict[str, Any]]]):
    """Every turn answered in order with the uninterrupted run's greedy tokens (a turn whose
    reply was lost is checked through the turns after it), and every acknowledged turn in the
    log, as acknowledged."""
    for conv, tokens, turns in zip(conversations, reference, stored, strict=True):
        assert [r["turn"] for r in conv.replies] == list(range(len(conv.messages)))
        got = [r.get("token_ids", want) for r, want in zip(conv.replies, tokens, strict=True)]
        assert got == tokens, conv.conv_id
        assert [t["text"] for t in turns] == [r["text"] for r in conv.replies]


def test_an_engine_killed_under_load_its_conversations_go_on_at_the_other(
    reference, tmp_path: Path
) -> None:
    with NatsCluster(tmp_path / "nats") as cluster:
        a = EngineProcess(cluster.urls[0], tmp_path / "a")
        b = EngineProcess(cluster.urls[1], tmp_path / "b")
        again: EngineProcess | None = None
        try:
            a_id, b_id = a.wait_ready(), b.wait_ready()
            firsts = [a_id, a_id, b_id]  # two conversations made at A, one at B
            conversations = [
                Conversation(chat, first) for chat, first in zip(CHATS, firsts, strict=True)
            ]
            acknowledged: list[int] = []

            async def run() -> float:
                talking = [talk(cluster.urls, c, acknowledged) for c in conversations]
                tasks = [asyncio.ensure_future(t) for t in talking]
                await after(acknowledged, 0, tasks, lambda: all(c.replies for c in conversations))
                a.kill()
                killed = time.monotonic()
                await asyncio.gather(*tasks)
                return killed

            killed = asyncio.run(run())
            for conv in conversations[:2]:  # A's: each went on within FAILOVER_S of the kill
                later = [t for t in conv.answered_at if t > killed]
                assert later and later[0] - killed < FAILOVER_S, (later[0] - killed, conv)
                assert conv.conv_id is not None and subjects.owner(conv.conv_id) == a_id
            stored = [
                asyncio.run(stored_turns(cluster.urls, c.conv_id or "")) for c in conversations
            ]
            check(conversations, reference, stored)

            # A starts again on its store: the conversations B adopted stay B's
            again = EngineProcess(cluster.urls[0], tmp_path / "a")
            assert again.wait_ready() == a_id

            async def once_more() -> dict[str, Any]:
                client = await nats.connect(cluster.urls)
                try:
                    body = {
                        "message": "One more?",
                        "max_tokens": 2,
                        "conversation_id": conversations[0].conv_id,
                    }
                    own = subjects.engine_subject(a_id, subjects.CHAT)  # sent to A itself
                    msg = await client.request(own, orjson.dumps(body), timeout=60)
                    return dict(orjson.loads(msg.data))
                finally:
                    await client.close()

            reply = asyncio.run(once_more())
            assert reply.get("turn") == len(CHATS[0]), reply
        finally:
            if a.proc.poll() is None:  # the test failed before it killed A
                a.kill()
            codes = [p.stop() for p in (b, again) if p is not None]
        assert codes == [0] * len(codes), [b.log()]
        # A's store has none of the turns B served after adopting the conversation
        with ConversationStore(tmp_path / "a") as store:
            old = store.turns(conversations[0].conv_id or "")
        assert 1 <= len(old) < len(CHATS[0])
        assert [t.assistant_text for t in old] == [t["text"] for t in stored[0][: len(old)]]


def test_an_adopted_conversation_refuses_a_turn_its_log_has_committed(tmp_path: Path) -> None:
    with NatsCluster(tmp_path / "nats") as cluster:
        a = EngineProcess(cluster.urls[0], tmp_path / "a")
        b = EngineProcess(cluster.urls[1], tmp_path / "b")
        try:
            a_id, b_id = a.wait_ready(), b.wait_ready()

            async def run() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
                client = await nats.connect(cluster.urls, max_reconnect_attempts=-1)
                try:
                    own = subjects.engine_subject(a_id, subjects.CHAT)
                    body = {"message": "Name a colour.", "max_tokens": MAX_TOKENS}
                    first = orjson.loads((await client.request(own, orjson.dumps(body), 60)).data)
                    conv_id = first["conversation_id"]
                    again = {**body, "conversation_id": conv_id, "message": "Another?", "turn": 1}
                    second = orjson.loads((await client.request(own, orjson.dumps(again), 60)).data)
                    assert second.get("turn") == 1, second
                    a.kill()  # B has never seen the conversation: it counts the log's turns
                    at_b = subjects.engine_subject(b_id, subjects.CHAT)
                    while True:  # refused `unavailable` until A's lease runs out
                        msg = await client.request(at_b, orjson.dumps(again), timeout=60)
                        refused = dict(orjson.loads(msg.data))
                        if refused.get("error", {}).get("code") != "unavailable":
                            break
                        await asyncio.sleep(0.2)
                    following = {**again, "message": "And a third?", "turn": 2}
                    msg = await client.request(at_b, orjson.dumps(following), timeout=60)
                    return first, refused, dict(orjson.loads(msg.data))
                finally:
                    await client.close()

            first, refused, third = asyncio.run(run())
            assert refused.get("error", {}).get("code") == "conflict", refused
            assert "has 2 turns" in refused["error"]["message"], refused
            assert third.get("turn") == 2, third
            turns = asyncio.run(stored_turns(cluster.urls[1:], first["conversation_id"]))
            assert [t["message"] for t in turns] == ["Name a colour.", "Another?", "And a third?"]
        finally:
            a.stop()
            assert b.stop() == 0, b.log()


def test_a_nats_node_killed_then_an_engine_drained_no_acknowledged_turn_is_lost(
    reference, tmp_path: Path
) -> None:
    with NatsCluster(tmp_path / "nats") as cluster:
        a = EngineProcess(cluster.urls[0], tmp_path / "a", "--shutdown-grace", "10")
        b = EngineProcess(cluster.urls[1], tmp_path / "b")
        try:
            a_id, b_id = a.wait_ready(), b.wait_ready()
            conversations = [
                Conversation(chat, first)
                for chat, first in zip(CHATS, [a_id, b_id, a_id], strict=True)
            ]
            acknowledged: list[int] = []
            total = sum(len(c.messages) for c in conversations)
            drained: list[float] = []

            async def run() -> None:
                tasks = [
                    asyncio.ensure_future(talk(cluster.urls, c, acknowledged))
                    for c in conversations
                ]
                await after(acknowledged, len(conversations), tasks)
                cluster.nodes[0].kill()  # the node A is connected to
                await after(acknowledged, 2 * len(conversations) + 1, tasks)
                assert await asyncio.to_thread(a.stop) == 0, a.log()  # SIGTERM: a drain
                drained.append(time.monotonic())
                await asyncio.gather(*tasks)

            asyncio.run(run())
            assert len(acknowledged) == total
            stored = [
                asyncio.run(stored_turns(cluster.urls[1:], c.conv_id or "")) for c in conversations
            ]
            check(conversations, reference, stored)
            assert "let go of" in a.log(), a.log()
        finally:
            a.stop()
            assert b.stop() == 0, b.log()
