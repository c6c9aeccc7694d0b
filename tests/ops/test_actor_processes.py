"""`pensieve actor`: every actor of an engine in a process of its own (ingress, two tokenizer
replicas, scheduler, recompute planner, executor), meeting on a real nats-server, with the real
SmolLM2 on the CPU and tiers small enough that histories are swapped out, swapped in and
dropped.

Three conversations run at once while each actor in turn is killed with SIGKILL and started
again. Clients send each turn until it is answered (a turn refused `unavailable`, or whose
requester heard nothing, is sent again, saying the turn number it expects, so that it is never
committed twice). No acknowledged turn is lost, and every conversation's
greedy tokens equal those of an uninterrupted stateless in-process run."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from pensieve.actors.wire import subjects
from pensieve.ops.nats_server import EmbeddedNats
from tests.ops.serving import stateless_references

pytestmark = pytest.mark.slow

CHATS = [
    [
        "What is the capital of France?",
        "And of Italy?",
        "Which of the two is bigger?",
        "Name a river in each.",
        "Which is longer?",
    ],
    [
        "Give me a word that rhymes with cat.",
        "Another one?",
        "Use both in a sentence.",
        "Now make it a question.",
        "Answer it.",
    ],
    [
        "How many legs does a spider have?",
        "And an ant?",
        "Which has more?",
        "Name another insect.",
        "How many legs does it have?",
    ],
]
MAX_TOKENS = 16
# each actor's options: the scheduler renders nothing itself, the tokenizer actors do, in
# processes of their own
MODEL = ["--model", "smollm2"]
OPTIONS = {
    "executor": [*MODEL, "--gpu-cache-tokens", "320", "--cpu-cache-tokens", "512"]
    + ["--cpu-threads", "1"],
    "scheduler": [*MODEL, "--admission-reserve", "0", "--max-batch-tokens", "512"]
    + ["--tokenizers", "0"],
    "tokenizer": [*MODEL, "--tokenizers", "1"],
    "ingress": [],
    "recompute-planner": [],
}
# which line each actor prints once it serves
READY = {
    "ingress": "ready on",
    "tokenizer": "ready on",
    "executor": "ready on",
    "recompute-planner": "ready on",
    "scheduler": "serving on",
}
# the executor and the scheduler first: the turns after them, on a warm cache again, meet the
# CPU tier
KILL_ORDER = ("executor", "scheduler", "recompute-planner", "tokenizer", "ingress")
POLICY_TURNS = 4  # turns of each chat under each policy: histories outgrow the GPU tier by then


@pytest.fixture(scope="module")
def reference(smollm2, smollm2_chat, tmp_path_factory) -> list[list[list[int]]]:
    """Greedy tokens of each chat's turns, replayed in-process with the stateless policy."""
    folder = tmp_path_factory.mktemp("chat")
    return stateless_references(smollm2, smollm2_chat, CHATS, MAX_TOKENS, folder)


class Actor:
    """`pensieve actor NAME` in a subprocess; its stderr is read for the line it announces."""

    def __init__(self, name: str, url: str, data_dir: Path, *extra: str) -> None:
        self.name = name
        command = [
            sys.executable,
            "-m",
            "pensieve.ops.cli",
            "actor",
            name,
            *OPTIONS[name],
            "--nats-url",
            url,
            "--data-dir",
            str(data_dir),
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            self.lines.append(line)
            if text in line:
                return
        raise AssertionError(f"no {text!r} from {self.name}:\n{''.join(self.lines)}")

    def wait_ready(self) -> None:
        self.wait_for(READY[self.name])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@dataclass
class Conversation:
    """One client's conversation: its acknowledged replies, and the turns it had to resend."""

    messages: list[str]
    conv_id: str | None = None
    replies: list[dict[str, Any]] = field(default_factory=list)
    num_resent: int = 0


async def send_until_answered(client: Any, conv: Conversation, message: str) -> dict[str, Any]:
    """The turn's reply, sending it again while it is refused `unavailable` or unanswered. A
    requester that heard nothing asks the conversation's state first, as a careful client
    would: a turn committed before its reply was lost is not sent again (its reply is the
    stored turn, without token ids). The turn says the number it expects, so a copy that
    reaches the engine once another is committed, or running, is refused `conflict`, and the
    client reads the stored turn then too."""
    body: dict[str, Any] = {"message": message, "max_tokens": MAX_TOKENS}
    if conv.conv_id is not None:
        body.update(conversation_id=conv.conv_id, turn=len(conv.replies))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            msg = await client.request(subjects.CHAT, orjson.dumps(body), timeout=30)
            reply = dict(orjson.loads(msg.data))
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            reply = {"error": {"code": "unavailable", "message": "nobody answered"}}
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
        conv.num_resent += 1
        await asyncio.sleep(0.5)
    raise AssertionError(f"{message!r} was never answered")


async def stored_turn(client: Any, conv: Conversation) -> dict[str, Any] | None:
    """The conversation's next turn if the store has it (waiting while a turn is running)."""
    if conv.conv_id is None:
        return None  # a lost first turn made a conversation nobody knows: start another
    body = orjson.dumps({"conversation_id": conv.conv_id})
    while True:
        try:
            msg = await client.request(subjects.CONVERSATIONS_GET, body, timeout=10)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await asyncio.sleep(0.5)
            continue
        got = orjson.loads(msg.data)
        if "error" in got:
            await asyncio.sleep(0.5)  # e.g. no scheduler yet
        elif got["busy"]:
            await asyncio.sleep(0.5)
        elif got["num_turns"] > len(conv.replies):
            turn = got["turns"][len(conv.replies)]
            return {"conversation_id": conv.conv_id, "turn": turn["turn"], "text": turn["text"]}
        else:
            return None


async def talk(url: str, conv: Conversation, acknowledged: list[int]) -> None:
    client = await nats.connect(url, max_reconnect_attempts=-1)
    try:
        for message in conv.messages:
            reply = await send_until_answered(client, conv, message)
            assert "error" not in reply, reply
            conv.conv_id = reply["conversation_id"]
            conv.replies.append(reply)
            acknowledged.append(1)
    finally:
        await client.close()


async def kill_each_in_turn(
    actors: dict[str, Actor], url: str, data_dir: Path, acknowledged: list[int], every: int
) -> list[str]:
    """Kill each actor of KILL_ORDER as soon as `every` more turns are acknowledged, and start
    it again (the others go on meanwhile); returns the ones killed (all of them, unless the
    conversations end first) once every restarted actor is ready."""
    total = sum(len(chat) for chat in CHATS)
    killed: list[str] = []
    restarts: list[asyncio.Future[None]] = []
    for name in KILL_ORDER:
        target = min(len(acknowledged) + every, total)
        while len(acknowledged) < target:
            await asyncio.sleep(0.1)
        if len(acknowledged) == total:
            break
        actors[name].kill()
        killed.append(name)
        actors[name] = Actor(name, url, data_dir)
        restarts.append(asyncio.ensure_future(asyncio.to_thread(actors[name].wait_ready)))
    await asyncio.gather(*restarts)
    return killed


async def scheduler_stats(url: str) -> dict[str, Any]:
    client = await nats.connect(url)
    try:
        reply = await client.request(subjects.STATS, b"{}", timeout=30)
    finally:
        await client.close()
    stats: dict[str, Any] = orjson.loads(reply.data)
    return stats


def test_each_actor_killed_under_load_rejoins_and_every_turn_keeps_its_tokens(
    reference, tmp_path
) -> None:
    with EmbeddedNats() as server:
        url = server.url
        # the scheduler starts first and waits for the executor; the ingress takes requests
        # before anything else is up and answers them `unavailable`
        actors = {"scheduler": Actor("scheduler", url, tmp_path)}
        actors["scheduler"].wait_for("waiting for the executor")
        for name in ("ingress", "executor", "recompute-planner", "tokenizer"):
            actors[name] = Actor(name, url, tmp_path)
        spare = Actor("tokenizer", url, tmp_path)  # the tokenizer's second replica
        try:
            for actor in (*actors.values(), spare):
                actor.wait_ready()
            conversations = [Conversation(chat) for chat in CHATS]
            acknowledged: list[int] = []

            async def run() -> list[str]:
                talking = [talk(url, conv, acknowledged) for conv in conversations]
                killing = kill_each_in_turn(actors, url, tmp_path, acknowledged, every=2)
                *_, killed = await asyncio.gather(*talking, killing)
                return killed

            killed = asyncio.run(run())
        finally:
            codes = {name: actor.stop() for name, actor in actors.items()}
            spare.stop()
    assert killed == list(KILL_ORDER)
    for conv, tokens in zip(conversations, reference, strict=True):
        assert [r["turn"] for r in conv.replies] == list(range(len(conv.messages)))
        # a turn whose reply was lost is checked through the turns after it, whose greedy
        # tokens depend on its own
        got = [r.get("token_ids", want) for r, want in zip(conv.replies, tokens, strict=True)]
        assert got == tokens, conv.conv_id
    usage = [r["usage"]["prompt_sources"] for conv in conversations for r in conv.replies]
    # histories kept on the GPU across turns, and recomputed after the executor's restart
    assert any(u["gpu"] for u in usage) and any(u["recomputed"] for u in usage), usage
    assert codes == dict.fromkeys(codes, 0), {n: a.lines[-20:] for n, a in actors.items()}


async def stream_then_stop(url: str, chat: Any, want: list[int]) -> None:
    """A streamed turn's deltas add up to its reply, whose greedy tokens are `want`; the same
    turn with a stop string from the middle of that reply ends at the token that completes it,
    its text before it (the text found by the tokenizer actor in a process of its own)."""
    client = await nats.connect(url)
    try:
        body = {"message": CHATS[0][0], "max_tokens": MAX_TOKENS, "stream": True}
        inbox = client.new_inbox()
        sub = await client.subscribe(inbox)
        await client.publish(subjects.CHAT, orjson.dumps(body), reply=inbox)
        deltas = []
        while "done" not in (message := orjson.loads((await sub.next_msg(60)).data)):
            deltas.append(message["delta"])
        await sub.unsubscribe()
        assert message["token_ids"] == want and "".join(deltas) == message["text"]
        text = message["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        completes = next(n for n in range(1, len(want) + 1) if stop in chat.decode(want[:n]))
        body = {"message": CHATS[0][0], "max_tokens": MAX_TOKENS, "stop": [stop]}
        cut = orjson.loads((await client.request(subjects.CHAT, orjson.dumps(body), 60)).data)
        assert cut["token_ids"] == want[:completes] and cut["finish_reason"] == "stop"
        assert cut["text"] == text[: text.find(stop)]
    finally:
        await client.close()


def test_every_policy_gives_the_stateless_tokens_with_each_actor_in_its_own_process(
    reference, smollm2_chat, tmp_path
) -> None:
    """The cache paths of each policy on tiny tiers (kept, swapped, dropped and recomputed
    histories), through the actors in processes of their own: the greedy tokens of every turn
    equal the stateless in-process reference (itself equal to transformers'). One ingress,
    tokenizer and recompute planner serve every policy; the scheduler and the executor start
    again with the next one. Under the first, a streamed turn and a turn with a stop string
    too."""
    with EmbeddedNats() as server:
        url = server.url
        front = [
            Actor(name, url, tmp_path) for name in ("ingress", "tokenizer", "recompute-planner")
        ]
        try:
            for actor in front:
                actor.wait_ready()
            for policy in ("pensieve", "lru", "gpu-only", "stateless"):
                engine = [
                    Actor(name, url, tmp_path, "--policy", policy)
                    for name in ("executor", "scheduler")
                ]
                try:
                    for actor in engine:
                        actor.wait_ready()
                    conversations = [Conversation(chat[:POLICY_TURNS]) for chat in CHATS]

                    async def run(
                        conversations: list[Conversation] = conversations, policy: str = policy
                    ) -> None:
                        acknowledged: list[int] = []
                        await asyncio.gather(*(talk(url, c, acknowledged) for c in conversations))
                        if policy == "pensieve":
                            await stream_then_stop(url, smollm2_chat, reference[0][0])
                            # the scheduler's start-up heap is out of its garbage collections
                            assert (await scheduler_stats(url))["process"]["gc_frozen_objects"]

                    asyncio.run(run())
                finally:
                    codes = [actor.stop() for actor in engine]
                assert codes == [0, 0], [a.lines[-20:] for a in engine]
                for conv, tokens in zip(conversations, reference, strict=True):
                    got = [r["token_ids"] for r in conv.replies]
                    assert got == tokens[:POLICY_TURNS], (policy, conv.conv_id)
                    assert conv.num_resent == 0, policy
        finally:
            for actor in front:
                actor.stop()
