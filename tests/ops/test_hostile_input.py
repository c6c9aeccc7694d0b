"""A storm of generated hostile requests against one real server (a real nats-server, a real LMDB,
the real SmolLM2 on the CPU), sent over NATS as clients send them.

Hypothesis generates the requests: bodies near the request schema of every client subject (wrong
types, out-of-range and extreme numbers, empty, huge and control-token strings, unknown fields,
wrong conversation ids, bad `messages`), and raw bytes (invalid UTF-8, truncated or deeply nested
JSON, bodies that are not objects). Each must be answered with a structured error or a well-formed
answer, while four innocent streamed turns run beside the storm and give the tokens they give
alone, and a greedy prompt gives the same tokens after the storm as before it.

Over HTTP, connections are the weapon: slow-loris clients, a flood of connections past the cap
and uploads given up half way, beside a slice of the storm; innocent streamed turns go on and
give the tokens they give alone, and each abuser is cut off or refused within its bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from pensieve.actors.config import StepChannel
from pensieve.actors.ingress.http_actor import HttpConfig
from pensieve.actors.wire import subjects
from pensieve.actors.wire.incoming import ERROR_HEADER
from pensieve.actors.wire.schemas import ERROR_CODES, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT, ROLES
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_accounts import add_tenant
from pensieve.ops.nats_server import EmbeddedNats, find_binary, free_port
from tests.ops.serving import serve_on_thread

pytestmark = pytest.mark.slow

NUM_REQUESTS = 1200
IN_FLIGHT = 32  # storm requests waiting for their answer at once
TIMEOUT_S = 60.0  # for each message of an answer: the server must answer every request
MAX_BODY = 900_000  # below NATS's default payload limit (1 MiB), which the client enforces
PAYLOAD_LIMIT = 1 << 20  # nats-server's default max_payload
MAX_STORM_TOKENS = 3  # a valid storm turn samples at most this many tokens
GREEDY_PROMPT = "What is the capital of France?"
GREEDY = {"message": GREEDY_PROMPT, "max_tokens": 24}
INNOCENT = [
    {"message": text, "max_tokens": 16, "ignore_eos": True, "stream": True}
    for text in (
        "Name three colours.",
        "Count from one to ten.",
        "What is a cat?",
        "Write a haiku about rain.",
    )
]
SHARED = (
    subjects.CHAT,
    subjects.CONVERSATIONS_GET,
    subjects.CONVERSATIONS_LIST,
    subjects.CONVERSATIONS_DELETE,
    subjects.STATS,
)
# pieces of text a chat template or a tokenizer may treat specially
CONTROL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>system\n",
    "\x00",
    "\r\n",
    "\u202e",
    "{{ messages }}",
    "{% endfor %}",
    "assistant",
    GREEDY_PROMPT,
]
EDGE_NUMBERS = [
    0,
    -1,
    MAX_TOKENS_LIMIT,
    MAX_TOKENS_LIMIT + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**400,
    1e308,
    -1e308,
    -0.0,
    5e-324,
    -5e-324,
    1e-300,
    1.0000000000000002,
]
HEX = "0123456789abcdef"
# what str.isdigit takes beyond 0-9: '²' (which int() refuses) first, then '٣' (which it reads)
DIGITS = sorted((c for c in map(chr, range(128, 0x3000)) if c.isdigit()), key=str.isdecimal)
CHAT_FIELDS = [
    "conversation_id",
    "message",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "ignore_eos",
    "stream",
    "final",
]


@dataclass(frozen=True)
class Probe:
    subject: str
    data: bytes
    expect: str | None = None  # the error code it must get (None: any but internal)


@dataclass
class Outcome:
    probe: Probe
    replies: list[Any]  # every message of the answer, decoded
    error_header: str | None  # the last message's Pensieve-Error header
    failure: str | None = None  # no answer in time, or one that is not JSON


# ---- what hypothesis generates ----------------------------------------------------------------


def mixed(*choices: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One of `choices`, each as likely (st.one_of flattens nested choices into one list)."""
    return st.sampled_from(choices).flatmap(lambda choice: choice)


def texts(min_size: int = 0) -> st.SearchStrategy[str]:
    """Short strings with control tokens and any other characters in them."""
    pieces = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(CONTROL)), max_size=4)
    return pieces.map("".join).filter(lambda t: len(t) >= min_size)


def huge_texts() -> st.SearchStrategy[str]:
    """Prompts far beyond the model's context: 200,000 characters, of any kind or from outside
    the BMP (several tokens each, so that their token ids fill more than one NATS message)."""
    outside = st.characters(min_codepoint=0x10000)
    pattern = mixed(st.text(min_size=1, max_size=4), st.text(outside, min_size=1, max_size=4))
    return st.builds(lambda t: (t * 200_000)[:200_000], pattern)


def hostile() -> st.SearchStrategy[Any]:
    """A value of any JSON type (numbers at the edges of every range among them)."""
    return st.one_of(
        st.sampled_from(EDGE_NUMBERS),
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        texts(),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    )


def conversation_ids(engine_id: str, known: list[str]) -> st.SearchStrategy[Any]:
    hexes = st.text(HEX, min_size=1, max_size=16)
    return mixed(
        st.sampled_from(known),
        st.none(),
        texts(),
        hostile(),
        st.builds(lambda h: f"c-{engine_id}-{h}", hexes),  # this engine's, never made
        st.builds(
            lambda e: f"c-{e}-0123456789abcdef",  # an engine that is not running
            st.text(HEX, min_size=8, max_size=8),
        ),
        st.builds(lambda c, n: c * n, st.characters(), st.sampled_from([199, 200, 201])),
    )


def chats() -> st.SearchStrategy[list[Any]]:
    """`messages` lists: mostly well formed, with bad roles, contents and entries among them."""
    role = st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "User", ""]), texts())
    entry = st.one_of(
        st.fixed_dictionaries({"role": role, "content": texts()}),
        st.fixed_dictionaries({"role": role, "content": hostile()}),
        st.fixed_dictionaries({"role": role}, optional={"content": texts(), "name": texts()}),
        hostile(),
    )
    said = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": texts()})
    last = st.fixed_dictionaries({"role": st.just("user"), "content": texts()})
    chat = st.builds(lambda head, tail: [*head, tail], st.lists(said, max_size=3), last)
    return st.one_of(
        chat,
        chat,
        st.lists(entry, max_size=4),
        st.just([{"role": "user", "content": GREEDY_PROMPT}]),
    )


def chat_bodies(ids: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Valid chat turns (cheap ones: at most MAX_STORM_TOKENS tokens) with optional fields at
    their edges; `near` breaks some of them."""
    message = st.fixed_dictionaries({"message": mixed(st.just(GREEDY_PROMPT), texts(1))})
    messages = st.fixed_dictionaries({"messages": chats()})
    both = st.fixed_dictionaries({"message": texts(), "messages": chats()})
    prompt = mixed(message, message, messages, messages, both)
    temperature = st.one_of(
        st.sampled_from([0.0, -0.0, 5e-324, 1e-40, 1e-300, 1e308]), st.floats(0.0, 2.0)
    )
    top_p = st.one_of(st.sampled_from([1.0, 5e-324, 1e-300]), st.floats(0.0, 1.0, exclude_min=True))
    stop = st.one_of(texts(1), st.lists(texts(1), max_size=MAX_STOP_STRINGS + 1))
    fields = st.fixed_dictionaries(
        {"max_tokens": st.integers(1, MAX_STORM_TOKENS)},
        optional={
            "conversation_id": ids,
            "temperature": temperature,
            "top_p": top_p,
            "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
            "stop": stop,
            "ignore_eos": st.booleans(),
            "stream": st.booleans(),
            "final": st.booleans(),
        },
    )
    return st.builds(lambda a, b: {**a, **b}, fields, prompt)


def cheap(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body with its `max_tokens` cut to at most MAX_STORM_TOKENS where the schema
    would accept more (a valid storm turn must cost little: the default of 256 tokens takes a
    minute on a 2-core CPU)."""
    max_tokens = body.get("max_tokens", 1)
    if type(max_tokens) is int and 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        return {**body, "max_tokens": 1 + (max_tokens - 1) % MAX_STORM_TOKENS}
    return body


def near(valid: st.SearchStrategy[dict[str, Any]], keys: list[str]) -> st.SearchStrategy[Any]:
    """`valid` bodies with up to two fields (known or not) set to a hostile value or removed."""
    key = st.one_of(st.sampled_from([*keys, "colour", ""]), st.text(max_size=6))
    change = st.tuples(key, st.one_of(st.just(None), st.tuples(hostile())))
    return st.builds(_changed, valid, st.lists(change, max_size=2))


def _changed(body: dict[str, Any], changes: list[tuple[str, tuple[Any] | None]]) -> dict[str, Any]:
    body = dict(body)
    for key, value in changes:
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value[0]
    return body


def histories_at_the_limit() -> st.SearchStrategy[bytes]:
    """Chat bodies of a whole history (`messages`) at or just under the payload limit: a
    conversation past what one message carries to the engine's actors (refused too_long by
    the ingress, by the render's size or by its token count)."""

    def body(slack: int, dense: bool, pad: str) -> bytes:
        filler = " " if dense else pad
        turns = [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": GREEDY_PROMPT},
        ]
        empty = len(orjson.dumps({"messages": turns, "max_tokens": 1}))
        size = PAYLOAD_LIMIT - slack - empty
        turns[1]["content"] = (filler * size)[:size]
        return orjson.dumps({"messages": turns, "max_tokens": 1})

    slack = st.sampled_from([0, 1, 12, 64, 200, 3000, 50_000])
    return st.builds(body, slack, st.booleans(), st.sampled_from("xa0="))


def raw_bodies(json_bodies: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    nested = st.sampled_from(
        [
            lambda n: b"[" * n + b"]" * n,
            lambda n: b'{"a":' * n + b"1" + b"}" * n,
            lambda n: b'{"message": "hi", "max_tokens": 1, "stop": ' + b"[" * n + b"]" * n + b"}",
        ]
    )
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from(
            [
                b"",
                b" \n",
                b"null",
                b"[]",
                b"1",
                b'"x"',
                b"\xff\xfe",
                b"{",
                b"\x00",
                b'{"message": "\xc3\x28", "max_tokens": 1}',
                b"NaN",
                b"Infinity",
            ]
        ),
        st.builds(lambda f, n: f(n), nested, st.sampled_from([100, 1023, 1024, 1025, 100_000])),
        json_bodies.flatmap(lambda data: st.integers(1, len(data)).map(lambda n: data[:n])),
        st.builds(lambda b: b'{"max_tokens": 1, "message": "' + b + b'"}', st.binary(max_size=24)),
        st.builds(
            lambda c, escaped: encoded({"max_tokens": 1, "message": c}, escaped),
            st.characters(categories=["Cs"]),
            st.booleans(),
        ),  # no UTF-8 holds a surrogate
    )


def encoded(body: Any, ascii_only: bool) -> bytes:
    """JSON as the stdlib writes it: any size of integer, and lone surrogates left in the UTF-8
    (ascii_only=False) or escaped (True), which no JSON parser may accept."""
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def probes(engine_id: str, kept: list[str], doomed: list[str]) -> st.SearchStrategy[Probe]:
    """Requests to every client subject; those to delete name the `doomed` conversations, the
    others the `kept` ones (which the storm may extend and end, so that reads find them)."""
    ids = conversation_ids(engine_id, kept)
    limit = mixed(st.integers(1, 1000), hostile())
    get_cursor = mixed(
        st.text("0123456789", max_size=3),
        st.text(DIGITS, min_size=1, max_size=3),
        hostile(),
        st.builds(lambda d, n: d * n, st.sampled_from("09"), st.sampled_from([20, 4301])),
    )
    list_cursor = mixed(
        st.text(HEX + "ABCDEF ", max_size=40),
        hostile(),
        st.builds(lambda n: "ab" * n, st.sampled_from([0, 16, 600, 100_000])),
    )
    bodies = {
        subjects.CHAT: near(chat_bodies(ids), CHAT_FIELDS).map(cheap),
        subjects.CONVERSATIONS_GET: near(
            st.fixed_dictionaries(
                {"conversation_id": mixed(st.sampled_from(kept), ids), "cursor": get_cursor},
                optional={"limit": limit},
            ),
            ["conversation_id", "cursor", "limit"],
        ),
        subjects.CONVERSATIONS_LIST: near(
            st.fixed_dictionaries({}, optional={"cursor": list_cursor, "limit": limit}),
            ["cursor", "limit"],
        ),
        subjects.CONVERSATIONS_DELETE: near(
            st.fixed_dictionaries({"conversation_id": conversation_ids(engine_id, doomed)}),
            ["conversation_id"],
        ),
        subjects.STATS: near(st.just({}), []),
    }
    any_json = st.builds(encoded, st.one_of(*bodies.values(), hostile()), st.booleans())
    flood = st.fixed_dictionaries(
        {"message": huge_texts(), "max_tokens": st.integers(1, MAX_STORM_TOKENS)},
        optional={"conversation_id": ids, "stream": st.booleans(), "stop": texts(1)},
    )  # a tenth of the chat requests: prompts far beyond the model's context

    @st.composite
    def probe(draw: st.DrawFn) -> Probe:
        shared = draw(st.sampled_from(SHARED))
        subject = draw(st.sampled_from([shared, subjects.engine_subject(engine_id, shared)]))
        pick = draw(st.sampled_from(range(10))) if shared == subjects.CHAT else None
        if pick == 0:
            return Probe(subject, encoded(draw(flood), ascii_only=False))
        if pick == 1 and draw(st.sampled_from(range(4))) == 0:  # histories past the limit
            return Probe(subject, draw(histories_at_the_limit()), "too_long")
        own = st.builds(encoded, bodies[shared], st.booleans())
        return Probe(subject, draw(mixed(own, own, any_json, raw_bodies(own))))

    return probe().filter(lambda p: len(p.data) <= (PAYLOAD_LIMIT if p.expect else MAX_BODY))


def generate(engine_id: str, kept: list[str], doomed: list[str], num: int) -> list[Probe]:
    """`num` probes, the same on every run (hypothesis is derandomized)."""
    found: list[Probe] = []

    @settings(
        max_examples=num,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(probes(engine_id, kept, doomed))
    def collect(probe: Probe) -> None:
        found.append(probe)

    collect()
    return found


# ---- talking to the server --------------------------------------------------------------------


async def exchange(client: Client, subject: str, data: bytes) -> tuple[list[Any], dict[str, str]]:
    """Send one request; every message of its answer (streamed deltas, then the final one)
    decoded, and the final message's headers."""
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    try:
        await client.publish(subject, data, reply=inbox)
        replies: list[Any] = []
        while True:
            msg = await sub.next_msg(timeout=TIMEOUT_S)
            replies.append(orjson.loads(msg.data))
            if not (isinstance(replies[-1], dict) and "delta" in replies[-1]):
                return replies, dict(msg.headers or {})
    finally:
        await sub.unsubscribe()


async def storm(client: Client, probes: list[Probe]) -> list[Outcome]:
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(probe: Probe) -> Outcome:
        async with gate:
            try:
                replies, headers = await exchange(client, probe.subject, probe.data)
            except Exception as error:  # a timeout or a reply that is not JSON
                return Outcome(probe, [], None, f"{type(error).__name__}: {error}")
            return Outcome(probe, replies, headers.get(ERROR_HEADER))

    return list(await asyncio.gather(*(one(p) for p in probes)))


@dataclass
class Streamed:
    deltas: list[str]
    final: dict[str, Any]
    ended: float  # time.monotonic() when the final message came


async def stream(client: Client, body: dict[str, Any], started: asyncio.Event) -> Streamed:
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await client.publish(subjects.CHAT, orjson.dumps(body), reply=inbox)
    deltas: list[str] = []
    while True:
        part = orjson.loads((await sub.next_msg(timeout=TIMEOUT_S)).data)
        started.set()
        if "delta" not in part:
            await sub.unsubscribe()
            return Streamed(deltas, part, time.monotonic())
        deltas.append(part["delta"])


async def storm_beside_innocents(
    url: str, probes: list[Probe]
) -> tuple[float, list[Outcome], list[Streamed]]:
    """The innocent turns are streaming when the storm begins (at the time returned first)."""
    client = await nats.connect(url)
    try:
        started = [asyncio.Event() for _ in INNOCENT]
        innocents = [
            asyncio.ensure_future(stream(client, body, event))
            for body, event in zip(INNOCENT, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), TIMEOUT_S)
        began = time.monotonic()
        outcomes = await storm(client, probes)
        return began, outcomes, list(await asyncio.gather(*innocents))
    finally:
        await client.close()


def ask(url: str, subject: str, body: dict[str, Any]) -> list[Any]:
    async def go() -> list[Any]:
        client = await nats.connect(url)
        try:
            return (await exchange(client, subject, orjson.dumps(body)))[0]
        finally:
            await client.close()

    return asyncio.run(go())


# ---- what counts as an answer -----------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    engine_id: str
    greedy: list[int]  # the greedy prompt's tokens


def problem(outcome: Outcome, expected: Expected) -> str | None:
    """What is wrong with the answer to one probe, or None."""
    if outcome.failure is not None:
        return outcome.failure
    *deltas, final = outcome.replies
    if outcome.probe.expect is not None:
        code = final.get("error", {}).get("code") if isinstance(final, dict) else None
        if code != outcome.probe.expect:
            return f"{code}, not {outcome.probe.expect}"
    if isinstance(final, dict) and "error" in final:
        error = final["error"]
        if not (
            isinstance(error, dict)
            and error.get("code") in ERROR_CODES
            and isinstance(error.get("message"), str)
            and error["message"]
        ):
            return "an error body without a known code and a message"
        if error["code"] == "internal" or outcome.error_header != error["code"]:
            return f"error {error['code']} (header {outcome.error_header})"
        return None
    kind = outcome.probe.subject.rsplit(".", 1)[-1]
    if outcome.error_header is not None or (deltas and kind != "chat"):
        return "an answer with an error header, or streamed where nothing streams"
    body = orjson.loads(outcome.probe.data) if outcome.probe.data.strip() else {}
    if kind == "chat":
        return _chat_problem(body, deltas, final, expected)
    return None if _answers(kind, body, final, expected) else f"a malformed {kind} answer"


def _answers(kind: str, body: dict[str, Any], reply: Any, expected: Expected) -> bool:
    if not isinstance(reply, dict):
        return False
    if kind == "get":
        keys = {
            "conversation_id",
            "turns",
            "num_turns",
            "num_tokens",
            "busy",
            "ended",
            "next_cursor",
            "created_at",
            "opening",
        }
        return set(reply) == keys and reply["conversation_id"] == body["conversation_id"]
    if kind == "list":
        keys = {"conversations", "next_cursor", "engine_id"}
        return set(reply) == keys and reply["engine_id"] == expected.engine_id
    if kind == "delete":
        return reply == {"conversation_id": body["conversation_id"], "deleted": True}
    return reply.get("engine_id") == expected.engine_id and "requests" in reply  # stats


def _chat_problem(
    body: dict[str, Any], deltas: list[Any], reply: Any, expected: Expected
) -> str | None:
    tokens = reply.get("token_ids") if isinstance(reply, dict) else None
    if not (
        isinstance(tokens, list)
        and all(type(t) is int for t in tokens)
        and 1 <= len(tokens) <= body["max_tokens"]
        and isinstance(reply.get("text"), str)
        and reply.get("finish_reason") in ("stop", "length")
        and reply.get("usage", {}).get("completion_tokens") == len(tokens)
        and subjects.owner(reply.get("conversation_id")) == expected.engine_id
    ):
        return "a malformed chat reply"
    if body.get("stream"):
        if reply.get("done") is not True or "".join(d["delta"] for d in deltas) != reply["text"]:
            return "streamed deltas that do not add up to the reply"
    elif deltas or "done" in reply:
        return "a streamed answer to a turn that asked for none"
    if _greedy(body) and tokens != expected.greedy[: body["max_tokens"]]:
        return f"greedy tokens {tokens}, not {expected.greedy[: body['max_tokens']]}"
    return None


def _greedy(body: dict[str, Any]) -> bool:
    """Whether the turn is a new one on the greedy prompt, sampled greedily and without stops:
    a temperature below float32's smallest normal is greedy, and so is a top_p too small to
    keep more than the likeliest token of a distribution that is not flat."""
    prompt = body.get("message", body.get("messages"))
    temperature, top_p = body.get("temperature", 0.0), body.get("top_p", 1.0)
    return (
        prompt in (GREEDY_PROMPT, [{"role": "user", "content": GREEDY_PROMPT}])
        and body.get("conversation_id") is None
        and not body.get("stop")
        and (temperature < 1e-38 or (top_p < 1e-30 and temperature <= 1.0))
    )


def describe(outcome: Outcome, problem: str) -> str:
    data = outcome.probe.data
    return (
        f"{problem}: {str(outcome.replies[-1:])[:200]} for {outcome.probe.subject} <- "
        f"{data[:100]!r} ({len(data)} bytes)"
    )


# ---- the test ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def engine_id(smollm2, smollm2_chat, nats_url, http_port, tmp_path_factory) -> Iterator[str]:
    """One engine with small KV tiers (the storm's conversations push others to the CPU tier and
    out), its model behind the executor actor as between processes; yields its id."""
    options = EngineOptions(
        model="smollm2", gpu_cache_tokens=2048, cpu_cache_tokens=2048, max_batch_tokens=512
    )
    built = assemble(options, smollm2, smollm2_chat)
    store = tmp_path_factory.mktemp("store")
    http = HttpConfig(http_port, model="smollm2", **HTTP_LIMITS)
    with serve_on_thread(built, store, nats_url, step_channel=StepChannel.NATS, http=http) as (
        own_id,
        _,
    ):
        yield own_id
    built.engine.kv.check_invariants()


def test_a_storm_of_hostile_requests_gets_only_structured_errors_or_answers(
    nats_url: str, engine_id: str
) -> None:
    url = nats_url
    before = ask(url, subjects.CHAT, GREEDY)[-1]
    alone = [ask(url, subjects.CHAT, body)[-1] for body in INNOCENT]
    assert len(before["token_ids"]) > MAX_STORM_TOKENS and not any("error" in r for r in alone)
    kept = [before["conversation_id"], *(r["conversation_id"] for r in alone)]
    doomed = [
        ask(url, subjects.CHAT, {"message": "Hi", "max_tokens": 1})[-1]["conversation_id"]
        for _ in range(2)
    ]
    probes = generate(engine_id, kept, doomed, NUM_REQUESTS)
    assert len(probes) >= 1000

    began, outcomes, innocents = asyncio.run(storm_beside_innocents(url, probes))

    for streamed, reference in zip(innocents, alone, strict=True):
        assert streamed.ended > began  # it was streaming while the storm went on
        assert len(streamed.deltas) > 1 and streamed.final["done"] is True
        assert "".join(streamed.deltas) == streamed.final["text"] == reference["text"]
        assert streamed.final["token_ids"] == reference["token_ids"]
    assert ask(url, subjects.CHAT, GREEDY)[-1]["token_ids"] == before["token_ids"]
    # still answering, with nothing left in flight (once the engine has settled: a stats
    # request during a step answers from a snapshot of the step before)
    deadline = time.monotonic() + 10
    while True:
        stats = ask(url, subjects.STATS, {})[-1]
        settled = stats["age_s"] == 0 and stats["requests"]["waiting"] == 0
        if (settled and stats["turns_in_flight"] == stats["requests"]["running"] == 0) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert stats["turns_in_flight"] == stats["requests"]["running"] == 0, stats
    assert stats["requests"]["waiting"] == 0
    expected = Expected(engine_id, before["token_ids"])
    problems = [describe(o, p) for o in outcomes if (p := problem(o, expected))]
    assert not problems, f"{len(problems)} of {len(outcomes)} answers are wrong:\n" + "\n".join(
        problems[:10]
    )


def test_a_body_at_the_payload_limit_is_refused_and_the_engine_stays_on_the_bus(
    nats_url: str, engine_id: str
) -> None:
    """A chat body just under NATS's payload limit fits as the client sends it but not with
    the headers the ingress adds when it hands it on; a message over the limit would make
    nats-server close the sender's connection for good. It is refused, and the engine goes on."""

    async def at_the_limit() -> list[list[Any]]:
        client = await nats.connect(nats_url)
        try:
            limit, empty = client.max_payload, len(orjson.dumps({"message": "", "max_tokens": 1}))
            answers = []
            for slack in (1, 200, 3000):
                body = orjson.dumps({"message": "x" * (limit - slack - empty), "max_tokens": 1})
                assert len(body) == limit - slack
                answers.append((await exchange(client, subjects.CHAT, body))[0])
            return answers
        finally:
            await client.close()

    for replies in asyncio.run(at_the_limit()):
        assert replies[-1]["error"]["code"] == "too_long", replies[-1]
    after = ask(nats_url, subjects.CHAT, GREEDY)[-1]
    assert "error" not in after and after["token_ids"], after


# ---- HTTP connection abuse --------------------------------------------------------------------

HTTP_LIMITS: dict[str, Any] = {"read_timeout_s": 1.0, "max_connections": 32}
NUM_LORISES = 8  # a header a byte at a time
NUM_SLOW_BODIES = 4  # the headers at once, the body a byte at a time
NUM_ABORTED = 8  # half a body, then the connection dropped
NUM_FLOOD = 48  # idle connections opened at once: past the cap with the others
NUM_STORM_SLICE = 48  # of the generated probes, over NATS meanwhile
CHAT_PATH = "/v1/chat/completions"


def http_innocent(text: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {
        "messages": messages,
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


async def http_text(session: aiohttp.ClientSession, url: str, text: str) -> str:
    async with session.post(url + CHAT_PATH, json=http_innocent(text, False)) as response:
        assert response.status == 200, await response.text()
        return str((await response.json())["choices"][0]["message"]["content"])


async def http_stream(url: str, text: str, started: asyncio.Event) -> tuple[int, str, float]:
    """One streamed turn on a connection of its own: its number of chunks, its text, and when
    it ended."""
    chunks, said = 0, ""
    body = http_innocent(text, True)
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + CHAT_PATH, json=body) as response,
    ):
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            started.set()
            chunks += 1
            for choice in orjson.loads(line[len(b"data: ") :])["choices"]:
                said += choice["delta"].get("content") or ""
    return chunks, said, time.monotonic()


async def held_until_closed(
    port: int, sent: bytes, dribbled: bytes = b"", every_s: float = 0.2
) -> tuple[float, bytes]:
    """A connection that sends `sent`, then `dribbled` a byte at a time; how long until the
    server closed it (from when it opened), and what the server sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    begin = time.monotonic()

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(sent)
            for byte in dribbled:
                await asyncio.sleep(every_s)
                writer.write(bytes([byte]))
                await writer.drain()

    sending = asyncio.ensure_future(send())
    got = b""
    try:
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), 30):
                got += chunk
        return time.monotonic() - begin, got
    finally:
        sending.cancel()
        writer.close()


async def aborted_upload(port: int) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n"
    writer.write(head.encode() + b'{"messages": [' + b" " * 20_000)
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.transport.abort()


async def http_abuse(port: int) -> dict[str, list[tuple[float, bytes]]]:
    """Every kind of connection abuse at once; what each abuser saw."""
    loris_head = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nX-Slow: {'a' * 100}\r\n\r\n".encode()
    slow_head = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n".encode()
    lorises = [held_until_closed(port, b"", loris_head) for _ in range(NUM_LORISES)]
    bodies = [held_until_closed(port, slow_head, b" " * 500) for _ in range(NUM_SLOW_BODIES)]
    aborted = [aborted_upload(port) for _ in range(NUM_ABORTED)]
    held = asyncio.gather(*lorises, *bodies, *aborted)
    await asyncio.sleep(0.3)  # they hold their connections: now the flood
    flood = await asyncio.gather(*(held_until_closed(port, b"") for _ in range(NUM_FLOOD)))
    seen = await held
    return {
        "lorises": seen[:NUM_LORISES],
        "slow bodies": seen[NUM_LORISES : NUM_LORISES + NUM_SLOW_BODIES],
        "flood": flood,
    }


async def http_abuse_beside_innocents(
    nats_url: str, port: int, probes: list[Probe]
) -> tuple[
    float, list[tuple[int, str, float]], dict[str, list[tuple[float, bytes]]], list[Outcome]
]:
    url = f"http://127.0.0.1:{port}"
    texts = [body["message"] for body in INNOCENT]
    started = [asyncio.Event() for _ in texts]
    innocents = asyncio.gather(
        *(http_stream(url, t, e) for t, e in zip(texts, started, strict=True))
    )
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), TIMEOUT_S)
    began = time.monotonic()
    client = await nats.connect(nats_url)
    try:
        seen, outcomes = await asyncio.gather(http_abuse(port), storm(client, probes))
    finally:
        await client.close()
    return began, await innocents, seen, outcomes


def test_http_connection_abuse_beside_innocent_turns_and_the_storm(
    nats_url: str, engine_id: str, http_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    url = f"http://127.0.0.1:{http_port}"

    async def alone() -> list[str]:  # each on a connection of its own, all at once
        async with aiohttp.ClientSession() as session:
            return list(
                await asyncio.gather(*(http_text(session, url, b["message"]) for b in INNOCENT))
            )

    references = asyncio.run(alone())
    made = [ask(nats_url, subjects.CHAT, {"message": "Hi", "max_tokens": 1}) for _ in range(2)]
    kept, doomed = ([reply[-1]["conversation_id"]] for reply in made)
    probes = generate(engine_id, kept, doomed, NUM_STORM_SLICE)
    began, innocents, seen, outcomes = asyncio.run(
        http_abuse_beside_innocents(nats_url, http_port, probes)
    )

    for (chunks, said, ended), reference in zip(innocents, references, strict=True):
        assert ended > began and chunks > 2 and said == reference
    timeout_s = HTTP_LIMITS["read_timeout_s"]
    for closed_after_s, sent in seen["lorises"]:
        assert timeout_s * 0.9 <= closed_after_s < timeout_s + 3 and sent == b""
    for closed_after_s, sent in seen["slow bodies"]:
        assert closed_after_s < timeout_s * 2 + 3 and sent.startswith(b"HTTP/1.1 408"), sent
    refused = [(t, sent) for t, sent in seen["flood"] if sent.startswith(b"HTTP/1.1 503")]
    let_in = [t for t, sent in seen["flood"] if not sent]  # idle until the read timeout
    assert len(refused) + len(let_in) == NUM_FLOOD and refused and let_in
    assert all(t < 2.0 for t, _ in refused) and all(t < timeout_s + 3 for t in let_in)

    # answered after as before, and no client's doing is a server error
    async def after() -> str:
        async with aiohttp.ClientSession() as session:
            return await http_text(session, url, INNOCENT[0]["message"])

    assert asyncio.run(after()) == references[0]
    expected = Expected(engine_id, ask(nats_url, subjects.CHAT, GREEDY)[-1]["token_ids"])
    problems = [describe(o, p) for o in outcomes if (p := problem(o, expected))]
    assert not problems, "\n".join(problems[:10])
    http_logs = [
        r for r in caplog.records if r.name.startswith(("aiohttp", "pensieve.actors.ingress.http"))
    ]
    assert not [r for r in http_logs if r.exc_info or r.levelno >= logging.ERROR], [
        (r.name, r.getMessage()) for r in http_logs if r.levelno >= logging.ERROR
    ]
    assert sum("went away" in r.getMessage() for r in http_logs) >= NUM_ABORTED


# ---- requests for a conversation of an engine that is not running ------------------------------

ABSENT = subjects.new_conversation_id("0badc0de", "0123456789abcdef")


@pytest.mark.parametrize(
    ("subject", "body"),
    [
        (subjects.CHAT, {"conversation_id": ABSENT, "message": "hi", "max_tokens": 0}),
        (subjects.CHAT, {"conversation_id": ABSENT, "message": "hi", "colour": "red"}),
        (subjects.CHAT, {"conversation_id": ABSENT, "message": "hi", "messages": []}),
        (subjects.CHAT, {"conversation_id": ABSENT, "prompt": "hi"}),
        (subjects.CHAT, {"conversation_id": ABSENT, "message": ""}),
        (subjects.CHAT, {"conversation_id": ABSENT, "message": "hi", "top_p": 0}),
        (subjects.CONVERSATIONS_GET, {"conversation_id": ABSENT, "cursor": "x"}),
        (subjects.CONVERSATIONS_GET, {"conversation_id": ABSENT, "limit": 0}),
        (subjects.CONVERSATIONS_DELETE, {"conversation_id": ABSENT, "cursor": "1"}),
        (subjects.CHAT_CANCEL, {"conversation_id": ABSENT, "stream": True}),
    ],
)
def test_an_invalid_request_naming_an_engine_that_is_not_running_is_invalid_request(
    nats_url: str, engine_id: str, subject: str, body: dict[str, Any]
) -> None:
    """Checked before it is routed: what is wrong with it is said, whichever engine it names
    (routed first, it was answered that the engine is not running)."""
    (reply,) = ask(nats_url, subject, body)
    assert reply["error"]["code"] == "invalid_request", reply


# ---- bodies at the payload limit, from a tenant and anonymously -------------------------------

SLACKS = (0, 1, 12, 200, 3000)  # bytes under the limit


def bodies_around_the_limit(limit: int) -> list[tuple[bytes, str]]:
    """Chat bodies of `limit` - slack bytes, each with the error it must get: valid ones are
    too_long (the ingress cannot hand them on with its headers, or the prompt passes the
    context), a body that is not a request is invalid_request at any size."""
    empty = len(orjson.dumps({"message": "", "max_tokens": 1}))
    found = []
    for slack in SLACKS:
        body = orjson.dumps({"message": "x" * (limit - slack - empty), "max_tokens": 1})
        found.append((body, "too_long"))
        unknown = body.replace(b'"max_tokens"', b'"max_tokenz"')  # an unknown field
        found.append((unknown, "invalid_request"))
        found.append((body[:-1], "invalid_request"))  # truncated JSON
    return found


async def around_the_limit(connect: dict[str, Any]) -> None:
    """Each body of `bodies_around_the_limit` gets its error on one connection, which stays
    open, and an ordinary turn on it is answered after them."""
    client = await nats.connect(**connect)
    try:
        for body, expected in bodies_around_the_limit(client.max_payload):
            assert len(body) <= client.max_payload
            replies, headers = await exchange(client, subjects.CHAT, body)
            error = replies[-1]["error"]
            assert error["code"] == headers[ERROR_HEADER] == expected, (len(body), error)
            assert error["message"]
        assert client.is_connected
        after = (await exchange(client, subjects.CHAT, orjson.dumps(GREEDY)))[0][-1]
        assert "error" not in after and after["token_ids"], after
    finally:
        await client.close()


def test_bodies_around_the_payload_limit_get_clear_errors_anonymously(
    nats_url: str, engine_id: str
) -> None:
    asyncio.run(around_the_limit({"servers": [nats_url]}))


@pytest.fixture(scope="module")
def tenant(smollm2, smollm2_chat, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """An engine on a nats-server with accounts, as `pensieve serve` starts it; yields how
    tenant alice connects."""
    data_dir = tmp_path_factory.mktemp("tenants")
    built = assemble(EngineOptions(model="smollm2", gpu_cache_tokens=1024), smollm2, smollm2_chat)
    with EmbeddedNats(auth_data_dir=data_dir) as server:
        assert server.service_auth is not None and server.events_auth is not None
        connect = server.service_auth.connect_options()
        events = server.events_auth.connect_options()
        with serve_on_thread(built, data_dir, server.url, connect=connect, events=events):
            yield add_tenant(data_dir, "alice")


def test_bodies_around_the_payload_limit_get_clear_errors_from_a_tenant(
    tenant: dict[str, Any],
) -> None:
    """A tenant's request reaches the service through its import, which adds a header of its
    own (`Nats-Request-Info`): nothing the ingress passes on may pass the limit for that."""
    asyncio.run(around_the_limit(tenant))


# ---- a conversation whose history passes the payload limit ------------------------------------

SMALL_PAYLOAD = 16_384  # a server's max_payload that a history of the 8k-token model can pass


@contextlib.contextmanager
def nats_with_max_payload(limit: int, folder: Path) -> Iterator[str]:
    """A real nats-server on loopback that takes messages of `limit` bytes at most."""
    port = free_port()
    config = folder / "nats-server.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {limit}\n")
    with subprocess.Popen(
        [
            find_binary(),
            "-c",
            str(config),
        ],
        stderr=subprocess.DEVNULL,
    ) as server:
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline and server.poll() is None
                    time.sleep(0.05)
            yield f"nats://127.0.0.1:{port}"
        finally:
            server.terminate()


def test_a_history_past_the_payload_limit_is_too_long_and_new_conversations_go_on(
    smollm2, smollm2_chat, tmp_path
) -> None:
    """Every turn renders its conversation's whole history in one message to a tokenizer
    replica; once the stored history passes what one message carries, each turn of that
    conversation is refused as too_long, saying what to do (before: internal, as the message
    could not be sent), and other conversations go on. The server's limit is small here, so
    that the 8k-token model's history can pass it: runs of spaces take 64 bytes a token."""
    built = assemble(EngineOptions(model="smollm2", gpu_cache_tokens=1024), smollm2, smollm2_chat)

    async def go(url: str) -> None:
        client = await nats.connect(url)
        try:
            assert client.max_payload == SMALL_PAYLOAD

            async def turn(body: dict[str, Any]) -> dict[str, Any]:
                reply = (await exchange(client, subjects.CHAT, orjson.dumps(body)))[0][-1]
                assert isinstance(reply, dict)
                return reply

            said = "Say hi." + " " * (SMALL_PAYLOAD // 2)
            first = await turn({"message": said, "max_tokens": 8, "ignore_eos": True})
            conv, history = first["conversation_id"], [said, first["text"]]
            # the longest message whose turn is still taken, found from above: the reply of
            # that turn takes the stored history past the limit
            spaces = SMALL_PAYLOAD - sum(len(t.encode()) for t in history)
            while True:
                message = "Go on." + " " * spaces
                body = {"conversation_id": conv, "message": message, "max_tokens": 200}
                reply = await turn({**body, "ignore_eos": True})
                if "error" not in reply:
                    break
                assert reply["error"]["code"] == "too_long", reply
                spaces -= 16
            history += [message, reply["text"]]
            assert sum(len(text.encode()) for text in history) > SMALL_PAYLOAD
            for _ in range(2):  # every turn: the same clear answer
                refused = await turn({"conversation_id": conv, "message": "Hi", "max_tokens": 1})
                assert refused["error"]["code"] == "too_long", refused
                assert "new conversation" in refused["error"]["message"], refused
            fresh = await turn({"message": "Hi", "max_tokens": 2})
            assert "error" not in fresh and len(fresh["token_ids"]) >= 1, fresh
        finally:
            await client.close()

    with (
        nats_with_max_payload(SMALL_PAYLOAD, tmp_path) as url,
        serve_on_thread(built, tmp_path / "store", url),
    ):
        asyncio.run(go(url))
