"""`pensieve actor`: the scheduler, the executor and two tokenizer replicas in processes of
their own, meeting on a real nats-server, with the real SmolLM2 on the CPU. Each conversation's
greedy tokens equal those of the stateless in-process reference, also across a tokenizer replica
killed with SIGKILL (the other renders), an executor killed and started again (its KV is gone:
the history is recomputed) and a scheduler killed and started again (it continues from the
store)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from pensieve.actors import subjects
from pensieve.ops.nats_server import EmbeddedNats
from tests.ops.serving import stateless_reference

pytestmark = pytest.mark.slow

CHAT = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?",
        "Name a river in each."]  # fmt: skip
MAX_TOKENS = 24
OPTIONS = ["--model", "smollm2", "--gpu-cache-tokens", "256", "--cpu-cache-tokens", "256",
           "--admission-reserve", "0", "--max-batch-tokens", "512",
           "--cpu-threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(smollm2, smollm2_chat, tmp_path_factory) -> list[list[int]]:
    """Greedy tokens of the chat's turns, replayed in-process with the stateless policy."""
    folder = tmp_path_factory.mktemp("chat")
    return stateless_reference(smollm2, smollm2_chat, CHAT, MAX_TOKENS, folder)


class Actor:
    """`pensieve actor NAME` in a subprocess; its stderr is read for the line it announces."""

    def __init__(self, name: str, url: str, data_dir: Path) -> None:
        # the scheduler renders nothing itself: the tokenizer actors do, in processes of their own
        tokenizers = ["--tokenizers", "1" if name == "tokenizer" else "0"]
        command = [sys.executable, "-m", "pensieve.ops.cli", "actor", name, *OPTIONS,
                   *tokenizers, "--nats-url", url, "--data-dir", str(data_dir)]  # fmt: skip
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
        raise AssertionError(f"no {text!r} from the actor:\n{''.join(self.lines)}")

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


def ask(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        client = await nats.connect(url)
        try:
            msg = await client.request(subjects.CHAT, orjson.dumps(body), timeout=timeout)
            return dict(orjson.loads(msg.data))
        finally:
            await client.close()

    return asyncio.run(go())


def chat_until_served(url: str, body: dict[str, Any], within_s: float = 90.0) -> dict[str, Any]:
    """Send the turn until it is not refused as unavailable (an actor is starting again)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            reply = ask(url, body)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            reply = {"error": {"code": "unavailable", "message": "no scheduler"}}
        if reply.get("error", {}).get("code") != "unavailable" or time.monotonic() > deadline:
            return reply
        time.sleep(1.0)


def test_killed_actors_rejoin_and_every_turn_keeps_its_tokens(reference, tmp_path) -> None:
    with EmbeddedNats() as server:
        url = server.url
        # the scheduler starts first and waits for the executor
        scheduler = Actor("scheduler", url, tmp_path)
        scheduler.wait_for("waiting for the executor")
        executor = Actor("executor", url, tmp_path)
        tokenizers = [Actor("tokenizer", url, tmp_path) for _ in range(2)]
        try:
            for actor in (executor, *tokenizers):
                actor.wait_for("ready on")
            scheduler.wait_for("serving on")
            first = ask(url, {"message": CHAT[0], "max_tokens": MAX_TOKENS})
            conv = first["conversation_id"]
            second = ask(url, {"conversation_id": conv, "message": CHAT[1],
                               "max_tokens": MAX_TOKENS})  # fmt: skip
            assert [first["token_ids"], second["token_ids"]] == reference[:2], (first, second)
            assert second["usage"]["cached_tokens"]["gpu"] > 0  # the executor kept the KV

            tokenizers[0].kill()  # the other replica renders the turns from here
            executor.kill()
            refused = ask(url, {"conversation_id": conv, "message": CHAT[2],
                                "max_tokens": MAX_TOKENS})  # fmt: skip
            assert refused["error"]["code"] == "unavailable", refused
            executor = Actor("executor", url, tmp_path)
            executor.wait_for("ready on")
            third = chat_until_served(url, {"conversation_id": conv, "message": CHAT[2],
                                            "max_tokens": MAX_TOKENS})  # fmt: skip
            assert third.get("token_ids") == reference[2], third
            assert third["turn"] == 2
            assert third["usage"]["cached_tokens"]["recomputed"] > 0  # the KV went with it

            scheduler.kill()
            scheduler = Actor("scheduler", url, tmp_path)
            scheduler.wait_for("serving on")
            fourth = chat_until_served(url, {"conversation_id": conv, "message": CHAT[3],
                                             "max_tokens": MAX_TOKENS})  # fmt: skip
            assert fourth.get("token_ids") == reference[3], fourth
            assert fourth["turn"] == 3
        finally:
            codes = [scheduler.stop(), executor.stop(), tokenizers[1].stop()]
            tokenizers[0].stop()
    assert codes == [0, 0, 0], scheduler.lines[-20:] + executor.lines[-20:]
