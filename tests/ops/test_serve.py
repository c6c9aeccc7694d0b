"""`pensieve serve` end to end: a real nats-server, a real LMDB, the real SmolLM2 on the CPU.

Clients talk to the server only over NATS, as users do. The reference for every reply is
`pensieve replay` with the stateless policy on the same chat (itself checked against
transformers in test_replay.py): the server's tiers are tiny, so history comes from the GPU, the
CPU tier and recomputation, and the tokens must not change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import nats
import nats.errors
import orjson
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pensieve.actors.config import DEFAULTS, StepChannel
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.scheduler.engine_thread import EngineThread
from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.incoming import ERROR_HEADER
from pensieve.actors.wire.request_parsing import parse_chat
from pensieve.actors.wire.schemas import ERROR_STATUS, ApiError
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.load import LoadOptions, run_load, server_moved
from pensieve.ops.nats_server import EmbeddedNats, free_port
from pensieve.ops.sharegpt import load_conversations
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore, StoreWriter
from tests.ops.serving import serve_on_thread, stateless_reference

pytestmark = pytest.mark.slow

CHAT = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"]
MAX_TOKENS = 40
TIERS = dict(gpu_cache_tokens=256, cpu_cache_tokens=256, admission_reserve=0.0)


@contextlib.contextmanager
def running_server(
    smollm2,
    chat,
    data_dir: Path,
    url: str,
    max_waiting: int = DEFAULTS.max_waiting,
    shutdown_grace_s: float = DEFAULTS.shutdown_grace_s,
) -> Iterator[Any]:
    """A fresh engine serving on `url` from a thread of its own, its model behind the executor
    actor and the per-step channel, as between processes."""
    options = EngineOptions(model="smollm2", max_batch_tokens=512, **TIERS)
    built = assemble(options, smollm2, chat)
    try:
        with serve_on_thread(built, data_dir, url, max_waiting, shutdown_grace_s, StepChannel.NATS):
            yield built
    finally:
        built.engine.kv.check_invariants()


# A request is sent again after NATS answers "no responders" (at most this many tries): twice in
# ~10 clean-clone CI runs on a loaded 2-core box, the first request to a server that had just
# reported ready (its subscriptions flushed to nats-server) got that answer, and it never happened
# on a rerun. A server that is really not subscribed still fails every try.
NO_RESPONDER_TRIES = 3


def ask(
    url: str,
    subject: str,
    body: Any,
    timeout: float = 120.0,
    headers: dict | None = None,
    connect: dict | None = None,
) -> tuple[list[dict], dict]:
    """Send one request (as the client `connect` says: the keyword arguments of nats.connect);
    returns every message that came back (streamed deltas, then the final one) and the final
    message's headers."""

    async def go() -> tuple[list[dict], dict]:
        client = await nats.connect(**{**(connect or {}), "servers": [url]})
        try:
            data = body if isinstance(body, bytes) else orjson.dumps(body)
            for attempt in range(NO_RESPONDER_TRIES):
                inbox = client.new_inbox()
                sub = await client.subscribe(inbox)
                await client.publish(subject, data, reply=inbox, headers=headers)
                got: list[dict] = []
                while True:
                    msg = await sub.next_msg(timeout=timeout)
                    if not msg.data and (msg.headers or {}).get("Status") == "503":
                        break  # nobody subscribed: see NO_RESPONDER_TRIES
                    got.append(orjson.loads(msg.data))
                    if "delta" not in got[-1]:
                        return got, dict(msg.headers or {})
                await sub.unsubscribe()
                await asyncio.sleep(0.5 * (attempt + 1))
            raise AssertionError(f"no responders on {subject} in {NO_RESPONDER_TRIES} tries")
        finally:
            await client.close()

    return asyncio.run(go())


def chat(url: str, headers: dict | None = None, connect: dict | None = None, **body: Any) -> dict:
    replies, headers = ask(url, subjects.CHAT, body, headers=headers, connect=connect)
    assert ERROR_HEADER not in headers, replies[-1]
    return replies[-1]


@pytest.fixture(scope="module")
def reference(smollm2, smollm2_chat, tmp_path_factory) -> list[list[int]]:
    """Greedy tokens of the three turns, replayed with the stateless policy."""
    folder = tmp_path_factory.mktemp("chat")
    return stateless_reference(smollm2, smollm2_chat, CHAT, MAX_TOKENS, folder)


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """Every span of this process, kept in memory (the global provider is set once)."""
    exporter = InMemorySpanExporter()
    setup_tracing(exporter)
    return exporter


@pytest.fixture(scope="module")
def served(smollm2, smollm2_chat, nats_url, tmp_path_factory, spans) -> Iterator[tuple[str, Any]]:
    store = tmp_path_factory.mktemp("store")
    with running_server(smollm2, smollm2_chat, store, nats_url) as built:
        yield nats_url, built


@pytest.fixture
def server(served) -> str:
    return served[0]


def _service(url: str, subject: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        client = await nats.connect(url)
        try:
            return dict(orjson.loads((await client.request(subject, b"", timeout=10)).data))
        finally:
            await client.close()

    return asyncio.run(go())


def test_the_load_client_drives_conversations_through_the_api(server, sharegpt20) -> None:
    """The load client (`ops/load.py`): three real conversations, two at a time, two streamed turns
    each; every turn is answered, later turns reuse the history, and the timings are consistent."""
    conversations = load_conversations(sharegpt20)[:3]
    options = LoadOptions(concurrency=2, max_turns=2, max_tokens=8, ignore_eos=True)

    async def go() -> dict[str, Any]:
        bus = await Bus.connect(server)
        try:
            return await run_load(bus, conversations, options)
        finally:
            await bus.close()

    summary = asyncio.run(go())
    assert summary["turns"] == 6 and summary["errors"] == {}
    assert summary["output_tokens"] == 6 * 8
    assert summary["cached_tokens"] > 0  # second turns hit the cache
    assert 0 < summary["ttft_s_p50"] <= summary["latency_s_p90"]
    assert summary["output_tok_per_s"] > 0
    server = summary["server"]  # the engine's own totals moved by exactly this load
    assert server["requests_finished"] == 6 and server["tokens"]["completion"] == 6 * 8
    assert server["tokens"]["prompt"] == summary["prompt_tokens"]
    sources = server["tokens"]["prompt_sources"]
    assert sources == summary["prompt_sources"]


def test_the_engine_answers_nats_service_discovery(server) -> None:
    """`nats micro list|info|stats` see the engine: its endpoints, and request and error counts
    that move with the requests it answers."""
    ping = _service(server, "$SRV.PING.pensieve")
    assert ping["type"] == "io.nats.micro.v1.ping_response" and ping["name"] == "pensieve"
    engine_id = ping["id"]
    info = _service(server, f"$SRV.INFO.pensieve.{engine_id}")
    assert info["type"] == "io.nats.micro.v1.info_response" and info["id"] == engine_id
    endpoints = {e["subject"]: e for e in info["endpoints"]}
    own_chat = subjects.engine_subject(engine_id, subjects.CHAT)
    assert {subjects.CHAT, subjects.CONVERSATIONS_LIST, own_chat} <= set(endpoints)
    assert endpoints[subjects.CHAT]["queue_group"] == "pensieve"

    def chat_stats() -> dict[str, Any]:
        stats = _service(server, "$SRV.STATS.pensieve")
        assert stats["type"] == "io.nats.micro.v1.stats_response" and stats["started"]
        return next(e for e in stats["endpoints"] if e["subject"] == subjects.CHAT)

    before = chat_stats()
    chat(server, message=CHAT[0], max_tokens=4)
    ask(server, subjects.CHAT, {"message": 7})
    after = chat_stats()
    assert after["num_requests"] == before["num_requests"] + 2
    assert after["num_errors"] == before["num_errors"] + 1
    assert after["last_error"].startswith("invalid_request")
    assert after["processing_time"] > before["processing_time"]
    assert after["average_processing_time"] == after["processing_time"] // after["num_requests"]


def test_a_conversation_over_nats_gives_the_stateless_tokens(server, reference) -> None:
    first = chat(server, message=CHAT[0], max_tokens=MAX_TOKENS)
    conv_id = first["conversation_id"]
    assert first["turn"] == 0 and first["token_ids"] == reference[0]
    assert first["usage"]["completion_tokens"] == len(reference[0])
    replies = [first]
    for turn, text in enumerate(CHAT[1:], start=1):
        reply = chat(server, conversation_id=conv_id, message=text, max_tokens=MAX_TOKENS)
        assert reply["conversation_id"] == conv_id and reply["turn"] == turn
        assert reply["token_ids"] == reference[turn]
        replies.append(reply)
    cached = [r["usage"]["prompt_sources"] for r in replies]
    reused = [c["gpu"] + c["cpu"] + c["recomputed"] for c in cached]
    # a new conversation reuses only chunks found by content (earlier tests sent its message)
    assert reused[0] == cached[0]["shared"] and reused[1] > reused[0] and reused[2] > reused[1]
    stored, _ = ask(server, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
    assert [t["text"] for t in stored[0]["turns"]] == [r["text"] for r in replies]
    assert [t["message"] for t in stored[0]["turns"]] == CHAT


def test_concurrent_conversations_each_get_their_own_tokens(served, reference) -> None:
    """Four conversations at once on a GPU tier of 8 blocks: history moves between the tiers."""
    server, built = served
    before = built.engine.totals.sources

    async def conversation(client: Any, salt: str) -> list[list[int]]:
        tokens, conv_id = [], None
        for text in CHAT[:2]:
            # a cache salt each: the four identical chats share no chunk, so the tiers fill
            body = {"message": text, "max_tokens": MAX_TOKENS, "cache_salt": salt}
            if conv_id is not None:
                body["conversation_id"] = conv_id
            msg = await client.request(subjects.CHAT, orjson.dumps(body), timeout=300)
            reply = orjson.loads(msg.data)
            conv_id = reply["conversation_id"]
            tokens.append(reply["token_ids"])
        return tokens

    async def go() -> list[list[list[int]]]:
        client = await nats.connect(server)
        try:
            return list(await asyncio.gather(*(conversation(client, f"{i}") for i in range(4))))
        finally:
            await client.close()

    assert asyncio.run(go()) == [reference[:2]] * 4
    moved = built.engine.totals.sources
    assert moved.cpu > before.cpu or moved.recomputed > before.recomputed


def _stats(url: str, connect: dict | None = None) -> dict[str, Any]:
    """The engine's stats as of now: asked again while it answers from a snapshot taken
    during a step (`age_s` > 0), which may miss the turns whose replies just went out."""
    for _ in range(200):
        replies, headers = ask(url, subjects.STATS, {}, connect=connect)
        assert ERROR_HEADER not in headers, replies[-1]
        if replies[-1]["age_s"] == 0:
            break
        time.sleep(0.01)
    return replies[-1]


KINDS = ("decode", "mixed", "prefill")


def test_the_stats_subject_adds_up_what_the_turns_reported(served) -> None:
    """`pensieve.v1.stats`: over four conversations of two turns at once on tiny tiers, the
    engine's totals move by exactly the sums of the replies' usage, every token that came
    from the CPU tier came in a swapped-in block, and nothing is left running."""
    server, built = served
    before = _stats(server)

    async def conversation(client: Any) -> list[dict[str, Any]]:
        replies: list[dict[str, Any]] = []
        for text in CHAT[:2]:
            body: dict[str, Any] = {"message": text, "max_tokens": MAX_TOKENS}
            if replies:
                body["conversation_id"] = replies[-1]["conversation_id"]
            msg = await client.request(subjects.CHAT, orjson.dumps(body), timeout=300)
            replies.append(orjson.loads(msg.data))
        return replies

    async def go() -> list[dict[str, Any]]:
        client = await nats.connect(server)
        try:
            done = await asyncio.gather(*(conversation(client) for _ in range(4)))
            return [reply for replies in done for reply in replies]
        finally:
            await client.close()

    replies = asyncio.run(go())
    after = _stats(server)
    assert after["engine_id"] == _service(server, "$SRV.PING.pensieve")["id"]
    assert after["policy"] == "pensieve" and after["turns_in_flight"] == 0
    assert after["requests"]["running"] == after["requests"]["waiting"] == 0
    assert after["requests"]["finished"] - before["requests"]["finished"] == len(replies) == 8

    def moved(*path: str) -> int:
        a, b = after, before
        for key in path:
            a, b = a[key], b[key]
        return int(a - b)

    usage = [r["usage"] for r in replies]
    assert moved("tokens", "prompt") == sum(u["prompt_tokens"] for u in usage)
    assert moved("tokens", "completion") == sum(u["completion_tokens"] for u in usage)
    for source in ("gpu", "cpu", "recomputed", "shared"):
        reported = sum(u["prompt_sources"][source] for u in usage)
        assert moved("tokens", "prompt_sources", source) == reported, source
    # (`shared` counts tokens of `gpu` and `cpu` found by content)
    cached = sum(u["cached_tokens"] + u["prompt_sources"]["recomputed"] for u in usage)
    assert moved("tokens", "prompt_sources", "new") == moved("tokens", "prompt") - cached
    cpu_tokens = moved("tokens", "prompt_sources", "cpu")
    assert cpu_tokens > 0  # the tiers are small enough for history to come back from the CPU
    block = after["cache"]["block_size"]
    assert moved("swaps", "in", "blocks") * block >= cpu_tokens
    assert moved("swaps", "out", "blocks") > 0
    block_bytes = built.engine.block_bytes
    for direction in ("in", "out"):
        swaps = after["swaps"][direction]
        assert swaps["bytes"] == swaps["blocks"] * block_bytes and swaps["seconds"] >= 0
    gpu, cpu = after["cache"]["gpu_blocks"], after["cache"]["cpu_blocks"]
    assert gpu["total"] == TIERS["gpu_cache_tokens"] // block
    assert cpu["total"] == TIERS["cpu_cache_tokens"] // block
    assert 0 <= gpu["free"] + gpu["reclaimable"] <= gpu["total"]
    assert 0 <= cpu["free"] <= cpu["total"]
    # the load's slowest step intervals, with where their time went
    # (each window keeps its longest: a window's earlier ones may crowd out the load's)
    logged = after["slow_steps"]
    assert logged["slowest"] and logged["loop_stalls"]  # the steps and the loop are watched
    slow = server_moved(before, after)["slow_steps"]
    assert all(s["at_s"] > before["slow_steps"]["now_s"] for s in slow)
    intervals = [s["interval_s"] for s in logged["slowest"]]
    assert intervals == sorted(intervals, reverse=True)
    for step in logged["slowest"]:
        assert step["interval_s"] >= step["step_s"] > 0
        assert step["phases"] is None or step["phases"]["kind"].split("+")[0] in KINDS


def test_a_stats_request_that_is_not_an_object_is_refused(server) -> None:
    replies, headers = ask(server, subjects.STATS, [1])
    assert headers.get(ERROR_HEADER) == "invalid_request"
    assert "object" in replies[-1]["error"]["message"]
    assert _stats(server)["requests"]["running"] == 0  # and the subject still answers


def test_streamed_deltas_add_up_to_the_reply(server, reference, smollm2_chat) -> None:
    replies, _ = ask(
        server, subjects.CHAT, {"message": CHAT[0], "max_tokens": MAX_TOKENS, "stream": True}
    )
    *deltas, final = replies
    assert len(deltas) > 1 and final["done"] is True
    assert "".join(d["delta"] for d in deltas) == final["text"]
    assert final["token_ids"] == reference[0]
    # each delta counts the reply's tokens shown so far: its text is theirs, decoded
    shown = [d["completion_tokens"] for d in deltas]
    assert shown == sorted(shown) and shown[0] > 0 and shown[-1] <= len(reference[0])
    text = ""
    for d in deltas:
        text += d["delta"]
        decoded = smollm2_chat.tokenizer.decode(reference[0][: d["completion_tokens"]])
        assert decoded.startswith(text)


def test_a_stateless_client_resending_its_history_hits_the_cache(server, reference) -> None:
    first = chat(server, message=CHAT[0], max_tokens=MAX_TOKENS)
    history = [
        {"role": "user", "content": CHAT[0]},
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": CHAT[1]},
    ]
    again = chat(
        server, conversation_id=first["conversation_id"], messages=history, max_tokens=MAX_TOKENS
    )
    assert again["token_ids"] == reference[1]
    assert again["usage"]["cached_tokens"] > 0


def test_a_raw_prompt_is_completed_as_transformers_completes_it(
    server, smollm2_chat, spans
) -> None:
    """`prompt` (a raw completion, no chat template): the text is encoded as it is, the greedy
    reply is transformers' on those ids, the same ids given as a list give the same reply, and
    the one-turn conversation it made has ended (its KV freed)."""
    from transformers import AutoModelForCausalLM

    from pensieve.models.assets import smollm2_gguf_path

    text = "The three primary colors are"
    ids = smollm2_chat.tokenizer.encode(text, add_special_tokens=True)
    by_text = chat(server, prompt=text, max_tokens=12)
    by_ids = chat(server, prompt=ids, max_tokens=12)
    assert by_text["usage"]["prompt_tokens"] == len(ids) == by_ids["usage"]["prompt_tokens"]
    assert by_text["token_ids"] == by_ids["token_ids"] and by_text["text"] == by_ids["text"]
    assert by_text["final"] is True
    traced = {
        s.attributes.get("gen_ai.operation.name")
        for s in spans.get_finished_spans()
        if s.attributes.get("gen_ai.conversation.id") == by_text["conversation_id"]
    }
    assert traced == {"text_completion"}
    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    want = reference.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=2
    )[0, len(ids) :].tolist()
    assert by_text["token_ids"] == want
    replies, headers = ask(
        server, subjects.CHAT, {"conversation_id": by_text["conversation_id"], "message": "And?"}
    )
    assert headers[ERROR_HEADER] and "ended" in replies[-1]["error"]["message"]
    for body, why in (
        ({"prompt": ""}, "non-empty"),
        ({"prompt": [1, "a"]}, "token ids"),
        ({"prompt": [10**9]}, "vocabulary"),
        ({"prompt": "x", "message": "y"}, "exactly one"),
        (
            {"prompt": "x", "conversation_id": by_ids["conversation_id"]},
            "continues no conversation",
        ),
    ):
        replies, headers = ask(server, subjects.CHAT, body)
        assert why in replies[-1]["error"]["message"], (body, replies)


def test_a_stop_string_ends_the_reply_before_it(server) -> None:
    full = chat(server, message=CHAT[0], max_tokens=MAX_TOKENS)["text"]
    middle = len(full) // 2
    stop = full[middle : middle + 3]
    assert stop.strip(), full
    cut = chat(server, message=CHAT[0], max_tokens=MAX_TOKENS, stop=[stop])
    assert cut["text"] == full[: full.find(stop)] and cut["finish_reason"] == "stop"
    assert len(cut["token_ids"]) < len(
        chat(server, message=CHAT[0], max_tokens=MAX_TOKENS)["token_ids"]
    )


@pytest.mark.parametrize(
    ("body", "code", "says"),
    [
        (b"{not json", "invalid_request", "JSON"),
        (b"[1, 2]", "invalid_request", "object"),
        ({"message": ""}, "invalid_request", "message"),
        ({"message": "hi", "messages": []}, "invalid_request", "exactly one"),
        ({"message": "hi", "max_tokens": 0}, "invalid_request", "max_tokens"),
        ({"message": "hi", "temperature": "hot"}, "invalid_request", "temperature"),
        ({"message": "hi", "colour": 1}, "invalid_request", "colour"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "invalid_request", "user"),
        ({"conversation_id": "nobody", "message": "hi"}, "not_found", "nobody"),
        ({"message": "tell me " * 9000}, "too_long", "context"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(
    server, reference, body, code, says
) -> None:
    replies, headers = ask(server, subjects.CHAT, body)
    assert headers.get(ERROR_HEADER) == code
    assert replies[-1]["error"]["code"] == code and says in replies[-1]["error"]["message"]
    # the NATS service protocol's error headers, for micro-service clients
    assert headers["Nats-Service-Error-Code"] == str(ERROR_STATUS[code])
    assert says in headers["Nats-Service-Error"]
    assert chat(server, message=CHAT[0], max_tokens=4)["token_ids"] == reference[0][:4]


def test_extreme_sampling_values_are_computed_and_hurt_no_other_turn(server, reference) -> None:
    """Temperatures and top_p values the schema accepts but float32 cannot divide by: each turn
    gets the greedy tokens (what such a distribution is), and a streamed greedy turn in flight
    beside them completes with its reference tokens."""
    extreme = [{"temperature": t} for t in (1e-40, 1e-300, 5e-324)]
    extreme += [{"temperature": 0.5, "top_p": 1e-300}, {"temperature": 1e-40, "top_p": 1e-300}]
    with ThreadPoolExecutor(len(extreme) + 1) as pool:
        innocent = pool.submit(chat, server, message=CHAT[0], max_tokens=MAX_TOKENS, stream=True)
        replies = [
            pool.submit(chat, server, message=CHAT[0], max_tokens=8, seed=3, **sampling)
            for sampling in extreme
        ]
        for reply in replies:
            assert reply.result()["token_ids"] == reference[0][:8]
        assert innocent.result()["token_ids"] == reference[0]


def test_max_waiting_counts_turns_from_their_arrival(smollm2, smollm2_chat, tmp_path) -> None:
    """Turns that have arrived but are still being tokenized count against --max-waiting: with
    two allowed, a third arriving turn is refused before the first two reach the engine, and
    one of them starting or being released makes room again."""
    built = assemble(EngineOptions(model="smollm2", **TIERS), smollm2, smollm2_chat)
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        service = ChatService(built.engine, built.chat, 4096, store, writer, max_waiting=2)
        request = parse_chat(orjson.dumps({"message": CHAT[0], "max_tokens": 2}))
        first, second = service.reserve(request), service.reserve(request)
        with pytest.raises(ApiError) as refused:
            service.reserve(request)
        assert refused.value.code == "overloaded"
        service.release(second)
        third = service.reserve(request)
        service.release(third)
        service.release(first)
        assert service.num_reserved == 0


def test_every_subject_refuses_unknown_fields_and_changes_nothing(server) -> None:
    conv_id = chat(server, message=CHAT[0], max_tokens=2)["conversation_id"]
    for subject, body in [
        (subjects.CONVERSATIONS_DELETE, {"conversation_id": conv_id, "force": True}),
        (subjects.CONVERSATIONS_GET, {"conversation_id": conv_id, "turns": 1}),
        (subjects.CONVERSATIONS_LIST, {"page": 10}),
        (subjects.CONVERSATIONS_CREATE, {"items": []}),
        (subjects.STATS, {"engine": "x"}),
    ]:
        replies, headers = ask(server, subject, body)
        assert headers.get(ERROR_HEADER) == "invalid_request", (subject, replies)
        assert "unknown field" in replies[-1]["error"]["message"]
    got, headers = ask(server, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
    assert ERROR_HEADER not in headers and len(got[0]["turns"]) == 1  # not deleted


def test_stopping_with_streams_in_flight_answers_every_requester(
    smollm2, smollm2_chat, tmp_path
) -> None:
    """Three long streamed turns are running when the server stops with a grace of half a
    second: each requester gets a final message (`unavailable`, send it again), none is left to
    wait out its timeout, and the engine thread stops cleanly (checked by `running_server`)."""
    body = {"message": CHAT[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with EmbeddedNats() as own, ThreadPoolExecutor(3) as pool:
        with running_server(smollm2, smollm2_chat, tmp_path, own.url, shutdown_grace_s=0.5):
            asks = [pool.submit(ask, own.url, subjects.CHAT, body, 30.0) for _ in range(3)]
            deadline = time.monotonic() + 60
            while _stats(own.url)["turns_in_flight"] < 3:
                assert time.monotonic() < deadline, "the turns never started"
                time.sleep(0.2)
        for replies, headers in (a.result() for a in asks):
            assert headers.get(ERROR_HEADER) == "unavailable", replies[-1]
            assert "shutting down" in replies[-1]["error"]["message"]


def test_a_refused_turn_leaves_its_conversation_free_for_the_next(server) -> None:
    conv_id = chat(server, message=CHAT[0], max_tokens=4)["conversation_id"]
    replies, headers = ask(
        server, subjects.CHAT, {"conversation_id": conv_id, "message": "tell me " * 9000}
    )
    assert headers.get(ERROR_HEADER) == "too_long", replies
    again = chat(server, conversation_id=conv_id, message=CHAT[1], max_tokens=4)
    assert again["turn"] == 1


MAX_MODEL_LEN = 160  # SmolLM2's context is 8192: two turns of this chat fit, a long third not


def test_a_prompt_over_max_model_len_is_too_long_and_its_conversation_is_intact(
    smollm2, smollm2_chat, tmp_path, reference
) -> None:
    """With --max-model-len, a turn whose history and new message come to more is refused
    `too_long` naming the limit; the conversation's stored turns are unchanged, and a later
    shorter turn on it gets the very tokens it gets where nothing was refused. A reply is cut to
    the room left: prompt and reply together reach the limit and no further."""
    options = EngineOptions(
        model="smollm2", max_batch_tokens=512, max_model_len=MAX_MODEL_LEN, **TIERS
    )
    built = assemble(options, smollm2, smollm2_chat)
    assert built.engine.max_model_len == MAX_MODEL_LEN
    with EmbeddedNats() as own, serve_on_thread(built, tmp_path, own.url):
        first = chat(own.url, message=CHAT[0], max_tokens=MAX_TOKENS)
        assert first["token_ids"] == reference[0]
        conv_id = first["conversation_id"]
        stored, _ = ask(own.url, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})

        long_turn = {"conversation_id": conv_id, "message": "tell me " * 60, "max_tokens": 1}
        replies, headers = ask(own.url, subjects.CHAT, long_turn)
        assert headers.get(ERROR_HEADER) == "too_long", replies
        assert f"context holds {MAX_MODEL_LEN}" in replies[-1]["error"]["message"], replies
        again, _ = ask(own.url, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
        assert again == stored

        second = chat(own.url, conversation_id=conv_id, message=CHAT[1], max_tokens=MAX_TOKENS)
        assert second["turn"] == 1 and second["token_ids"] == reference[1]
        third = chat(
            own.url, conversation_id=conv_id, message=CHAT[2], max_tokens=1000, ignore_eos=True
        )
        prompt_tokens = third["usage"]["prompt_tokens"]
        assert third["finish_reason"] == "length" and 0 < len(third["token_ids"]) < 1000
        assert prompt_tokens + len(third["token_ids"]) == MAX_MODEL_LEN


def test_conversations_are_listed_read_and_deleted(server) -> None:
    conv_id = chat(server, message=CHAT[0], max_tokens=4)["conversation_id"]
    listed, _ = ask(server, subjects.CONVERSATIONS_LIST, {})
    assert conv_id in listed[0]["conversations"]
    got, _ = ask(server, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
    assert len(got[0]["turns"]) == 1 and got[0]["num_tokens"] > 0
    deleted, _ = ask(server, subjects.CONVERSATIONS_DELETE, {"conversation_id": conv_id})
    assert deleted[0] == {"conversation_id": conv_id, "deleted": True}
    gone = [
        (subjects.CONVERSATIONS_GET, {"conversation_id": conv_id}),
        (subjects.CHAT, {"conversation_id": conv_id, "message": "hi"}),
    ]
    for subject, body in gone:
        replies, headers = ask(server, subject, body)
        assert headers.get(ERROR_HEADER) == "not_found", replies
    listed, _ = ask(server, subjects.CONVERSATIONS_LIST, b"")
    assert conv_id not in listed[0]["conversations"]
    missing, headers = ask(server, subjects.CONVERSATIONS_GET, {})
    assert headers.get(ERROR_HEADER) == "invalid_request"


def test_a_created_conversation_is_continued_from_its_messages(server) -> None:
    opening = [{"role": "system", "content": "Answer in French."}]
    (made,), headers = ask(server, subjects.CONVERSATIONS_CREATE, {"messages": opening})
    assert ERROR_HEADER not in headers, made
    conv_id = made["conversation_id"]
    (got,), _ = ask(server, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
    assert (got["num_turns"], got["opening"], got["turns"]) == (0, opening, [])
    assert conv_id in ask(server, subjects.CONVERSATIONS_LIST, {})[0][0]["conversations"]
    reply = chat(server, conversation_id=conv_id, message=CHAT[0], max_tokens=2)
    assert reply["turn"] == 0
    (got,), _ = ask(server, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id})
    assert got["opening"] == [] and got["turns"][0]["history"] == opening


def test_list_pages_through_every_conversation_once(server) -> None:
    made = {chat(server, message=CHAT[0], max_tokens=1)["conversation_id"] for _ in range(5)}
    seen: list[str] = []
    body: dict[str, Any] = {"limit": 2}
    while True:
        (page,), headers = ask(server, subjects.CONVERSATIONS_LIST, body)
        assert ERROR_HEADER not in headers and len(page["conversations"]) <= 2, page
        seen += page["conversations"]
        if page["next_cursor"] is None:
            break
        body = {"limit": 2, "cursor": page["next_cursor"]}
    assert made <= set(seen) and len(seen) == len(set(seen))
    for bad in ({"cursor": "not hex"}, {"limit": 0}, {"limit": 100_000}):
        replies, headers = ask(server, subjects.CONVERSATIONS_LIST, bad)
        assert headers.get(ERROR_HEADER) == "invalid_request", replies


def test_reads_are_answered_while_the_engine_is_inside_a_step(
    smollm2, smollm2_chat, tmp_path
) -> None:
    """A step that does not end (held on an event) does not hold up `conversations.get` and
    `.list`: they read the store off the engine thread. The turn completes once let go."""
    with EmbeddedNats() as own, running_server(smollm2, smollm2_chat, tmp_path, own.url) as built:
        conv_id = chat(own.url, message=CHAT[0], max_tokens=2)["conversation_id"]
        runner, entered, let_go = built.engine.runner, threading.Event(), threading.Event()
        launch = runner.launch

        def held(plan: Any, feed: Any = None) -> Any:
            entered.set()
            let_go.wait(60)
            return launch(plan, feed)

        runner.launch = held
        with ThreadPoolExecutor(1) as pool:
            turn = pool.submit(
                chat, own.url, conversation_id=conv_id, message=CHAT[1], max_tokens=2
            )
            assert entered.wait(30)
            listed, _ = ask(own.url, subjects.CONVERSATIONS_LIST, {}, timeout=10)
            got, _ = ask(
                own.url, subjects.CONVERSATIONS_GET, {"conversation_id": conv_id}, timeout=10
            )
            assert conv_id in listed[0]["conversations"] and got[0]["busy"] is True
            let_go.set()
            assert turn.result()["turn"] == 1
        runner.launch = launch


def test_a_restarted_server_continues_a_conversation_from_the_store(
    smollm2, smollm2_chat, reference, tmp_path
) -> None:
    with EmbeddedNats() as own:  # alone on its bus: the module's server would share the requests
        with running_server(smollm2, smollm2_chat, tmp_path, own.url):
            first = chat(own.url, message=CHAT[0], max_tokens=MAX_TOKENS)
        with running_server(smollm2, smollm2_chat, tmp_path, own.url):  # fresh, empty tiers
            second = chat(
                own.url,
                conversation_id=first["conversation_id"],
                message=CHAT[1],
                max_tokens=MAX_TOKENS,
            )
    assert first["token_ids"] == reference[0] and second["token_ids"] == reference[1]
    assert second["usage"]["prompt_sources"]["recomputed"] > 0  # the KV came from the token log


def test_two_engines_on_one_bus_keep_each_conversation_where_its_kv_is(
    smollm2, smollm2_chat, reference, tmp_path
) -> None:
    """Each engine has its own store and tiers. A conversation started on one engine and
    continued through the other engine's own subject, or through the shared subject (which
    either engine may take), is forwarded to the engine that holds it: the tokens are the
    reference's and the history comes from the cache, never `not_found`."""
    engine_ids = []
    for name in ("a", "b"):
        with ConversationStore(tmp_path / name) as store:
            engine_ids.append(store.engine_id())
            assert store.engine_id() == engine_ids[-1]  # kept, not drawn again
    assert engine_ids[0] != engine_ids[1]
    with EmbeddedNats() as bus, contextlib.ExitStack() as servers:
        for name in ("a", "b"):
            servers.enter_context(running_server(smollm2, smollm2_chat, tmp_path / name, bus.url))
        owned = {}
        for engine_id in engine_ids:  # one conversation started on each engine
            (first,), _ = ask(
                bus.url,
                subjects.engine_subject(engine_id, subjects.CHAT),
                {"message": CHAT[0], "max_tokens": MAX_TOKENS},
            )
            assert first["conversation_id"].startswith(f"c-{engine_id}-")
            assert first["token_ids"] == reference[0]
            owned[engine_id] = first["conversation_id"]
        for turn in (1, 2):
            for engine_id, other in zip(engine_ids, reversed(engine_ids), strict=True):
                body = {
                    "conversation_id": owned[engine_id],
                    "message": CHAT[turn],
                    "max_tokens": MAX_TOKENS,
                }
                subject = subjects.engine_subject(other, subjects.CHAT) if turn == 1 else None
                replies, headers = ask(bus.url, subject or subjects.CHAT, body)
                assert ERROR_HEADER not in headers, replies
                assert replies[-1]["token_ids"] == reference[turn]
                assert replies[-1]["usage"]["prompt_sources"]["gpu"] > 0
        for engine_id, other in zip(engine_ids, reversed(engine_ids), strict=True):
            (stored,), _ = ask(
                bus.url,
                subjects.engine_subject(other, subjects.CONVERSATIONS_GET),
                {"conversation_id": owned[engine_id]},
            )
            assert [t["message"] for t in stored["turns"]] == CHAT
            (listed,), _ = ask(
                bus.url, subjects.engine_subject(engine_id, subjects.CONVERSATIONS_LIST), {}
            )
            assert listed == {
                "conversations": [owned[engine_id]],
                "next_cursor": None,
                "engine_id": engine_id,
            }


def test_a_conversation_whose_engine_is_not_running_is_answered_unavailable_at_once(
    server,
) -> None:
    """Its id names an engine that is not on the bus: the request is refused at once instead of
    being forwarded to nobody (its requester would wait out its whole timeout)."""
    absent = subjects.new_conversation_id("0badc0de", "0123456789abcdef")
    for subject, body in [
        (subjects.CHAT, {"conversation_id": absent, "message": "hi"}),
        (subjects.CONVERSATIONS_GET, {"conversation_id": absent}),
    ]:
        begin = time.monotonic()
        replies, headers = ask(server, subject, body, timeout=10)
        assert headers.get(ERROR_HEADER) == "unavailable", replies
        assert "0badc0de" in replies[-1]["error"]["message"]
        assert time.monotonic() - begin < 3
    assert chat(server, message=CHAT[0], max_tokens=4)["turn"] == 0  # and it keeps serving


def test_a_failed_engine_step_is_answered_and_the_conversations_go_on_unchanged(
    smollm2, smollm2_chat, reference, tmp_path
) -> None:
    """One engine step raises (injected into the real runner). The turn in flight gets
    `internal`; sent again, it gives the reference tokens, with its history recomputed. A
    conversation that was idle meanwhile goes on unchanged too, and the cache's accounting holds
    (checked when the server stops)."""
    with EmbeddedNats() as own, running_server(smollm2, smollm2_chat, tmp_path, own.url) as built:
        idle = chat(own.url, message=CHAT[0], max_tokens=MAX_TOKENS)
        first = chat(own.url, message=CHAT[0], max_tokens=MAX_TOKENS)
        runner = built.engine.runner
        launch, failures = runner.launch, []

        def fail_once(plan: Any, feed: Any = None) -> Any:
            if not failures:
                failures.append(plan)
                raise RuntimeError("injected step failure")
            return launch(plan, feed)

        runner.launch = fail_once
        body = {
            "conversation_id": first["conversation_id"],
            "message": CHAT[1],
            "max_tokens": MAX_TOKENS,
        }
        replies, headers = ask(own.url, subjects.CHAT, body)
        assert headers.get(ERROR_HEADER) == "internal" and failures, replies
        assert "injected step failure" in replies[-1]["error"]["message"]
        again = chat(own.url, **body)
        later = chat(
            own.url, conversation_id=idle["conversation_id"], message=CHAT[1], max_tokens=MAX_TOKENS
        )
    assert first["token_ids"] == idle["token_ids"] == reference[0]
    assert again["turn"] == 1 and again["token_ids"] == reference[1]
    assert later["token_ids"] == reference[1]
    for reply in (again, later):  # the KV came back from the tokens, not from a suspect cache
        cached = reply["usage"]["prompt_sources"]
        assert cached["recomputed"] > 0
        # (the idle one may find by content chunks that `again` recomputed after the failure)
        assert cached["gpu"] + cached["cpu"] == (cached["shared"] if reply is later else 0)


def test_an_engine_that_cannot_be_reset_refuses_turns_at_once(
    smollm2, smollm2_chat, tmp_path
) -> None:
    """A step fails and so does the reset (as a device error that does not go away would): the
    turn in flight and every later one get `internal` at once, without another step."""
    with EmbeddedNats() as own, running_server(smollm2, smollm2_chat, tmp_path, own.url) as built:
        steps = []

        def broken_step(plan: Any, feed: Any = None) -> Any:
            steps.append(plan)
            raise RuntimeError("injected device error")

        def broken_abort_all(error: str) -> list[Any]:
            raise RuntimeError("injected: the device is gone")

        built.engine.runner.launch = broken_step
        built.engine.abort_all = broken_abort_all
        replies = [
            ask(own.url, subjects.CHAT, {"message": CHAT[0], "max_tokens": 4}) for _ in range(3)
        ]
        assert len(steps) == 1  # the engine stopped stepping after the failed reset
        for messages, headers in replies:
            assert headers.get(ERROR_HEADER) == "internal", messages
        assert "restart the server" in replies[-1][0][-1]["error"]["message"]


def test_a_cpu_engine_thread_runs_torch_on_the_threads_it_is_given(
    smollm2, smollm2_chat, tmp_path
) -> None:
    built = assemble(EngineOptions(model="smollm2", **TIERS), smollm2, smollm2_chat)
    before = torch.get_num_threads()
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        service = ChatService(built.engine, built.chat, 2048, store, writer)
        engine = EngineThread(service, cpu_threads=1)
        try:
            assert engine.call(torch.get_num_threads).result(timeout=10) == 1
        finally:
            engine.stop()
    assert torch.get_num_threads() == before  # the caller's threads are left alone


def _wait_until_served(url: str, within_s: float = 60.0) -> None:
    """Ask until the server answers (after a NATS restart each actor reconnects on its own
    schedule: "no responders" until the ingress has subscribed again, `unavailable` from the
    ingress until the scheduler has)."""

    async def wait() -> None:
        client = await nats.connect(url)
        try:
            deadline = time.monotonic() + within_s
            while True:
                try:
                    answer = await client.request(subjects.CONVERSATIONS_LIST, b"{}", timeout=1.0)
                    if ERROR_HEADER not in (answer.headers or {}):
                        return
                except nats.errors.Error:
                    pass
                assert time.monotonic() < deadline, f"no answer on {url} in {within_s} s"
                await asyncio.sleep(0.2)
        finally:
            await client.close()

    asyncio.run(wait())


def test_the_server_rides_out_a_nats_restart_and_stops_while_nats_is_down(
    smollm2, smollm2_chat, reference, tmp_path
) -> None:
    """NATS goes away between two turns and comes back on the same port: the server reconnects
    and the conversation goes on with the same tokens; then NATS goes away again and the
    server still stops cleanly (a drain towards a missing server used to raise). A step plan or
    its answer sent while the actors reconnect may be lost: its turn is answered `unavailable`,
    and sent again it gives the same tokens."""
    port = free_port()
    first_nats = EmbeddedNats(port).__enter__()
    with running_server(smollm2, smollm2_chat, tmp_path, first_nats.url):
        first = chat(first_nats.url, message=CHAT[0], max_tokens=MAX_TOKENS)
        first_nats.__exit__(None, None, None)
        with EmbeddedNats(port) as second_nats:
            _wait_until_served(second_nats.url)
            body = {
                "conversation_id": first["conversation_id"],
                "message": CHAT[1],
                "max_tokens": MAX_TOKENS,
            }
            for _ in range(3):
                replies, headers = ask(second_nats.url, subjects.CHAT, body)
                if headers.get(ERROR_HEADER) != "unavailable":
                    break
                time.sleep(1.0)  # as the answer says: retry
            assert ERROR_HEADER not in headers, replies
            second = replies[-1]
    assert first["token_ids"] == reference[0] and second["token_ids"] == reference[1]


def _serving_url(proc: subprocess.Popen[str]) -> tuple[str, list[str]]:
    """The NATS URL of the "serving on" line a `pensieve serve` process prints, and its log
    lines up to it."""
    url, lines, deadline = None, [], time.monotonic() + 180
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        if not line:
            break
        lines.append(line)
        if "serving on " in line:
            url = line.split("serving on ")[1].split()[0]
    assert url is not None, "".join(lines)
    return url, lines


def test_the_command_serves_with_its_own_nats_server_and_stops_on_sigterm(tmp_path) -> None:
    """By default its nats-server asks who connects: an anonymous client is refused, and a
    tenant added while it runs (`pensieve tenant add`) chats."""
    command = [
        sys.executable,
        "-m",
        "pensieve.ops.cli",
        "serve",
        "--model",
        "smollm2",
        "--data-dir",
        str(tmp_path),
        "--gpu-cache-tokens",
        "1024",
        "--cpu-cache-tokens",
        "1024",
        "--nats-port",
        str(free_port()),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, lines = _serving_url(proc)
        assert any("NATS authentication on" in line for line in lines), "".join(lines)
        with pytest.raises((nats.errors.Error, OSError)):  # nobody without credentials
            asyncio.run(nats.connect(url, allow_reconnect=False, connect_timeout=5))
        added = subprocess.run(
            [
                sys.executable,
                "-m",
                "pensieve.ops.cli",
                "tenant",
                "add",
                "me",
                "--data-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        me = json.loads(added.stdout)["nats"]
        assert me["password"] not in added.stderr and me["password"] not in "".join(lines)
        reply = chat(url, connect=me, message=CHAT[0], max_tokens=4)
        assert reply["turn"] == 0 and len(reply["token_ids"]) == 4
        stats = _stats(url, connect=me)
        assert stats["requests"]["finished"] == 1 and stats["tokens"]["completion"] == 4
        assert stats["process"]["gc_frozen_objects"] > 0  # the start-up heap is frozen
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with ConversationStore(tmp_path) as store:  # the turn was durable before the reply
        assert store.turns(reply["conversation_id"])[0].assistant_text == reply["text"]


def _finished_span(spans: InMemorySpanExporter, match: Any, wait_s: float = 10.0) -> Any:
    """The first finished span that `match` accepts (a request's span ends after its reply)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = [span for span in spans.get_finished_spans() if match(span)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError("no such span")


def test_a_request_is_traced_in_the_callers_trace_through_its_phases(served, spans) -> None:
    server, _ = served
    trace_id, caller = 0x5E551E7E0000000000000000000000AB, 0x00000000C0FFEE01
    traceparent = {"traceparent": f"00-{trace_id:032x}-{caller:016x}-01"}
    first = chat(server, headers=traceparent, message=CHAT[0], max_tokens=8)
    second = chat(
        server,
        headers=traceparent,
        conversation_id=first["conversation_id"],
        message=CHAT[1],
        max_tokens=8,
    )

    def turn_span(turn: int) -> Any:
        return _finished_span(
            spans,
            lambda s: (
                s.name == "turn"
                and s.context.trace_id == trace_id
                and s.attributes.get("pensieve.turn") == turn
            ),
        )

    span = turn_span(1)
    # the ingress's span of the request is the caller's child; the scheduler's turn is its own
    request = _finished_span(spans, lambda s: s.context.span_id == span.parent.span_id)
    assert request.name == subjects.CHAT and request.parent.span_id == caller
    assert request.resource.attributes["service.name"] == "pensieve-ingress"
    assert span.resource.attributes["service.name"] == "pensieve-scheduler"
    attrs = span.attributes
    assert attrs["pensieve.conversation_id"] == first["conversation_id"]
    assert attrs["pensieve.completion_tokens"] == len(second["token_ids"])
    usage = second["usage"]
    assert attrs["pensieve.cached_tokens"] == usage["cached_tokens"]
    sources = {k: attrs[f"pensieve.prompt_sources.{k}"] for k in usage["prompt_sources"]}
    assert sources == usage["prompt_sources"]
    # a first turn reuses only chunks found by content (earlier tests sent its message)
    opening = turn_span(0).attributes
    assert opening["pensieve.prompt_sources.gpu"] == opening["pensieve.prompt_sources.shared"]
    phases = {
        s.name: s
        for s in spans.get_finished_spans()
        if s.parent is not None and s.parent.span_id == span.context.span_id
    }
    # and kv.swap_in or kv.plan_recompute if its history came back from the CPU or was dropped
    assert {"tokenizer.render", "queued", "prefill", "decode"} <= set(phases)
    services = {name: s.resource.attributes["service.name"] for name, s in phases.items()}
    assert services["tokenizer.render"] == "pensieve-tokenizer"
    assert services["queued"] == "pensieve-scheduler"
    assert services["prefill"] == services["decode"] == "pensieve-executor"
    assert phases["queued"].end_time <= phases["prefill"].start_time
    render = phases["tokenizer.render"]  # in a tokenizer replica, before the engine has the turn
    assert request.start_time <= span.start_time <= render.start_time <= render.end_time
    assert render.end_time <= phases["prefill"].start_time
    assert phases["prefill"].start_time <= phases["prefill"].end_time
    assert phases["prefill"].end_time <= phases["decode"].start_time <= phases["decode"].end_time
    assert phases["decode"].end_time <= span.end_time


def test_a_refused_request_is_traced_as_an_error(server, spans) -> None:
    trace_id = 0x5E551E7E0000000000000000000000CD
    header = {"traceparent": f"00-{trace_id:032x}-{1:016x}-01"}
    ask(server, subjects.CHAT, {"message": ""}, headers=header)
    span = _finished_span(spans, lambda s: s.context.trace_id == trace_id)
    assert span.attributes["pensieve.error"] == "invalid_request"
    assert span.status.status_code.name == "ERROR"


def test_steps_that_move_kv_are_traced(server, spans) -> None:
    """More conversations than 8 GPU blocks hold: history leaves the GPU, and a returning
    conversation whose history waits in the CPU tier brings it back."""
    ids = [
        chat(server, message=f"{CHAT[0]} ({i})", max_tokens=40)["conversation_id"] for i in range(5)
    ]
    from_cpu = 0
    for conv_id in reversed(ids[:-1]):  # the most recently idle first: likeliest still on the CPU
        reply = chat(server, conversation_id=conv_id, message=CHAT[1], max_tokens=4)
        from_cpu = reply["usage"]["prompt_sources"]["cpu"]
        if from_cpu:
            break
    assert from_cpu > 0
    steps = [s.attributes for s in spans.get_finished_spans() if s.name == "step"]
    assert {
        s.resource.attributes["service.name"]
        for s in spans.get_finished_spans()
        if s.name == "step"
    } == {"pensieve-executor"}
    assert any(a["pensieve.swap_out_blocks"] + a["pensieve.evict_first_blocks"] > 0 for a in steps)
    assert any(a["pensieve.swap_in_blocks"] > 0 for a in steps)


def test_the_command_serves_a_model_split_over_two_ranks(tmp_path) -> None:
    """`--tensor-parallel 2`: two executor rank processes (gloo on the CPU) behind the server;
    a second turn hits the cache they keep, and SIGTERM stops them with the server."""
    command = [
        sys.executable,
        "-m",
        "pensieve.ops.cli",
        "serve",
        "--model",
        "preset:tiny-llama",
        "--data-dir",
        str(tmp_path),
        "--insecure",
        "--nats-port",
        str(free_port()),
        "--cpu-threads",
        "1",
        "--tensor-parallel",
        "2",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, lines = _serving_url(proc)
        assert any("2 tensor-parallel ranks" in line for line in lines), "".join(lines)
        first = chat(url, message=CHAT[0], max_tokens=6)
        second = chat(url, conversation_id=first["conversation_id"], message=CHAT[1], max_tokens=6)
        assert len(second["token_ids"]) == 6
        assert second["usage"]["prompt_sources"]["gpu"] >= first["usage"]["prompt_tokens"] - 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
