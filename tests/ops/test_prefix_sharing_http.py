"""Prefix sharing over HTTP with the official `openai` client: a real `pensieve serve` process
with its nats-server, tenants made by `pensieve tenant add`, the real SmolLM2 on the CPU.

A client that resends its history with assistant messages other than the ones the server
generated reuses everything up to the first differing token, in whole chunks; a second
conversation with the same long system prompt reuses it; no tenant, and no other cache salt,
ever hits another's prompt, except the prompts the operator names public (`--public-prompts`),
and then nothing after them. Expected counts are computed from the same chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from pensieve.actors.scheduler.request import common_prefix
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.models.assets import smollm2_tokenizer
from pensieve.ops.nats_server import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2"
BLOCK = 32
GREEDY = {"temperature": 0, "max_tokens": 8}
LONG = 320  # tokens of a system prompt a later turn finds cached, at least


def system_prompt(topic: str) -> str:
    """About 370 tokens of rules, unique to `topic` (more than `LONG`)."""
    return f"You answer questions about {topic}. " + " ".join(
        f"Rule {i}: keep answer {i} about {topic} short and polite." for i in range(24)
    )


class Server:
    """`pensieve serve --http-port` in a subprocess, with room for a few long prompts."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.data_dir = data_dir
        self.http_port = free_port()
        command = [
            *(sys.executable, "-m", "pensieve.ops.cli", "serve", "--model", MODEL),
            *("--data-dir", str(data_dir), "--nats-port", str(free_port())),
            *("--http-port", str(self.http_port), "--gpu-cache-tokens", "8192"),
            *("--cpu-cache-tokens", "2048", "--log-level", "warning", *extra),
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        lines: list[str] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            if "OpenAI-compatible API on" in line:
                return
        raise AssertionError(f"the server did not start:\n{''.join(lines)}")

    def client(self, tenant: str) -> OpenAI:
        """The official client with a new key of `tenant` (`pensieve tenant add`)."""
        done = subprocess.run(
            [sys.executable, "-m", "pensieve.ops.cli", "tenant", "add", tenant]
            + ["--data-dir", str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        key = json.loads(done.stdout)["http"]["api_key"]
        return OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=key, max_retries=0)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("data"))
    try:
        yield running
    finally:
        assert running.stop() == 0


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    tokenizer = smollm2_tokenizer()
    return ChatTokenizer(tokenizer, len(tokenizer))


def complete(api: OpenAI, messages: list[dict[str, str]], **extra: Any) -> tuple[Any, list[int]]:
    """One greedy reply, and its token ids."""
    extra = {"return_token_ids": True, **extra}
    reply = api.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **GREEDY)
    return reply, (reply.choices[0].model_extra or {})["token_ids"]


def cached(reply: Any) -> int:
    return int(reply.usage.prompt_tokens_details.cached_tokens)


PUBLIC_SYSTEM = {"role": "system", "content": system_prompt("tools")}


@pytest.fixture(scope="module")
def public_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("public")
    (folder / "public.json").write_text(json.dumps([[PUBLIC_SYSTEM]]))
    running = Server(folder / "data", "--public-prompts", str(folder / "public.json"))
    try:
        yield running
    finally:
        assert running.stop() == 0


def full_chunks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


def test_a_client_that_resends_other_replies_reuses_all_before_the_first_difference(
    server, chat
) -> None:
    api = server.client("stateless")
    messages = [{"role": "system", "content": system_prompt("rivers")}]
    log: list[int] = []  # the token log of the conversation that answered last
    for turn, question in enumerate(["Name a river.", "Another?", "And a third?"]):
        messages.append({"role": "user", "content": question})
        prompt = chat.render(messages)
        reply, ids = complete(api, messages)
        assert reply.usage.prompt_tokens == len(prompt)
        # the longest prefix cached: the last conversation's log, its last token never fed
        matching = min(common_prefix(log, prompt), len(log) - 1, len(prompt) - 1)
        expected = full_chunks(max(matching, 0))
        assert cached(reply) == expected, (turn, cached(reply), expected)
        if turn:
            assert expected >= full_chunks(len(chat.render(messages[:1])))
        log = prompt + ids
        # the client keeps a reply of its own: the chat index finds no conversation, content does
        messages.append({"role": "assistant", "content": f"My answer {turn} was: river."})


def test_a_second_conversation_reuses_the_system_prompt_of_the_first(server, chat) -> None:
    api = server.client("app")
    system = {"role": "system", "content": system_prompt("mountains")}
    first_chat = [system, {"role": "user", "content": "Name a mountain."}]
    second_chat = [system, {"role": "user", "content": "How high is Mont Blanc?"}]
    first, _ = complete(api, first_chat)
    second, _ = complete(api, second_chat)
    common = common_prefix(chat.render(first_chat), chat.render(second_chat))
    assert common >= LONG and cached(first) == 0
    assert cached(second) == full_chunks(common)
    assert second.usage.prompt_tokens_details.model_extra["prompt_sources"]["shared"] == cached(
        second
    )


def test_no_tenant_and_no_other_salt_hits_a_prompt(server, chat) -> None:
    alice, bob = server.client("alice"), server.client("bob")
    system = {"role": "system", "content": system_prompt("lakes")}

    def ask(api: OpenAI, question: str, **extra: Any) -> int:
        reply, _ = complete(api, [system, {"role": "user", "content": question}], **extra)
        return cached(reply)

    # each namespace finds what it cached (checked at once: the tiers hold a few such prompts)
    assert ask(alice, "Name a lake.") == 0
    assert ask(bob, "Name a lake.") == 0  # another tenant, the same chat
    assert ask(bob, "Name a blue lake.") >= LONG
    assert ask(alice, "Name a cold lake.") >= LONG
    assert ask(alice, "Name a large lake.", cache_salt="s") == 0  # another salt
    assert ask(alice, "Name a warm lake.", cache_salt="s") >= LONG
    assert ask(bob, "Name a lake!", cache_salt="s") == 0  # the same salt, another tenant
    assert ask(alice, "Name a deep lake.", cache_salt="t") == 0


def test_a_public_prompt_is_shared_across_tenants_and_what_follows_it_is_not(
    public_server, server, chat
) -> None:
    alice, bob = public_server.client("alice"), public_server.client("bob")
    public = chat.render([PUBLIC_SYSTEM], generation_prompt=False)
    public_cached = full_chunks(len(public))
    question = (
        "Which tool cuts wood? Answer in one short sentence that names the tool, says what "
        "it is made of and who would use it, please."
    )
    first = [PUBLIC_SYSTEM, {"role": "user", "content": question}]
    reply, first_ids = complete(alice, first)
    assert chat.render(first)[: len(public)] == public and public_cached >= LONG
    assert cached(reply) == 0
    # bob's first turn with the public prompt: its full chunks, found in alice's cache
    other = [PUBLIC_SYSTEM, {"role": "user", "content": "Which tool drives nails?"}]
    reply, _ = complete(bob, other)
    assert cached(reply) == public_cached
    # alice's second turn reuses her whole history; bob sending that chat gets the public part
    second = [*first, {"role": "assistant", "content": reply_text(first_ids)}]
    second.append({"role": "user", "content": "And which one drills holes?"})
    reply, alice_ids = complete(alice, second)
    log, prompt = chat.render(first) + first_ids, chat.render(second)
    own = full_chunks(min(common_prefix(log, prompt), len(log) - 1))
    assert cached(reply) == own > public_cached
    reply, bob_ids = complete(bob, second)
    assert cached(reply) == public_cached
    # a salted turn shares nothing outside its salt, public prompts included
    reply, _ = complete(bob, other, cache_salt="s")
    assert cached(reply) == 0
    # the same greedy tokens as a tenant of a server without public prompts, computed afresh
    fresh, fresh_ids = complete(server.client("fresh"), second)
    assert cached(fresh) == 0
    assert alice_ids == bob_ids == fresh_ids


def reply_text(ids: list[int]) -> str:
    return f"My answer was {len(ids)} tokens long."
