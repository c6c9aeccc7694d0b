"""The chat service's core, driven step by step without NATS (the real SmolLM2, a real LMDB):
a turn whose commit fails leaves its conversation exactly as before it, a deleted conversation
cannot be loaded again while the store is still deleting it, and a stop string ends a turn at
the same token however late the tokenizer's answer comes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.wire.messages import DetokenizeReply, DetokenizeRequest
from pensieve.actors.wire.request_parsing import encode_body, parse_chat
from pensieve.actors.wire.schemas import ApiError, Page
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.store import ConversationStore, StoreWriter, TurnRecord

pytestmark = pytest.mark.slow

CHAT = ["What is the capital of France?", "And of Italy?"]


class Sink:
    def __init__(self) -> None:
        self.settled = threading.Event()
        self.reply: dict[str, Any] | None = None
        self.refused: ApiError | None = None

    def delta(self, text: str, tokens: int) -> None:
        pass

    def done(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.settled.set()

    def error(self, error: ApiError) -> None:
        self.refused = error
        self.settled.set()


@pytest.fixture
def service(smollm2, smollm2_chat, tmp_path: Path) -> Iterator[ChatService]:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        yield ChatService(built.engine, built.chat, 4096, store, writer)


def turn(service: ChatService, **body: Any) -> Sink:
    """One turn through reserve, render, start and the step loop, until it is answered."""
    reservation = service.reserve(parse_chat(orjson.dumps({"max_tokens": 8, **body})))
    sink = Sink()
    service.start(reservation, service.chat.render(reservation.messages), sink)
    while service.has_work():
        service.step()
    assert sink.settled.wait(30)
    return sink


def test_a_failed_commit_leaves_the_conversation_as_before_the_turn(service) -> None:
    first = turn(service, message=CHAT[0]).reply
    assert first is not None
    conv_id = first["conversation_id"]
    store, commit = service.store, service.store.commit_turn
    store.commit_turn = lambda *args: (_ for _ in ()).throw(OSError("No space left on device"))
    failed = turn(service, conversation_id=conv_id, message=CHAT[1])
    assert failed.refused is not None and failed.refused.code == "internal"
    store.commit_turn = commit  # the disk has room again
    again = turn(service, conversation_id=conv_id, message=CHAT[1]).reply
    assert again is not None and again["turn"] == 1  # numbered as if the failed one never was
    assert [r.turn for r in store.turns(conv_id)] == [0, 1]
    assert store.turns(conv_id)[1].assistant_text == again["text"]


def test_a_deleted_conversation_is_not_loaded_again_before_the_store_forgets_it(
    service,
) -> None:
    conv_id = turn(service, message=CHAT[0]).reply["conversation_id"]  # type: ignore[index]
    service.conversations.clear()  # as after a restart: only the store knows it
    hold = threading.Event()
    service.writer.submit(hold.wait, 30)  # the writer is busy: the delete waits behind it
    deleted = service.delete(conv_id)
    with pytest.raises(ApiError) as gone:
        service.reserve(parse_chat(orjson.dumps({"conversation_id": conv_id, "message": "hi"})))
    assert gone.value.code == "not_found"
    hold.set()
    deleted.result(30)
    assert service.store.meta(conv_id) is None


def test_a_long_conversation_is_read_in_pages_that_each_fit_one_message(service) -> None:
    """40 turns of 60 kB each (2.4 MB, past NATS's 1 MiB payload): `get` answers them in pages
    under the limit, every turn once, in order."""
    conv_id, log = "c-long", []
    for number in range(40):
        record = TurnRecord(
            turn=number,
            user_message=f"question {number}",
            assistant_text="é" * 30_000,
            prompt_tokens=1,
            new_prompt_tokens=1,
            output_token_ids=(2,),
            finish_reason="length",
            cached_gpu=0,
            cached_cpu=0,
            cached_recomputed=0,
            started_at=1.0,
            finished_at=2.0,
        )
        service.store.commit_turn(conv_id, record, len(log), [3, 4])
        log += [3, 4]
    turns, cursor = [], None
    while True:
        answer = service.get(conv_id, Page(cursor, 1000))
        assert 0 < len(encode_body(answer)) < 1 << 20
        turns += [t.turn for t in answer.turns]
        cursor = answer.next_cursor
        if cursor is None:
            break
    assert turns == list(range(40)) and answer.num_turns == 40


def late_turn(service: ChatService, delay: int, **body: Any) -> dict[str, Any]:
    """One turn whose reply tokens reach the tokenizer's core only `delay` engine steps after
    they are sent (a slow or busy tokenizer replica): the engine keeps stepping meanwhile."""
    sent: list[tuple[int, DetokenizeRequest]] = []
    steps = 0
    service.detokenize = lambda request: sent.append((steps, request))
    reservation = service.reserve(parse_chat(orjson.dumps({"max_tokens": 8, **body})))
    sink = Sink()
    service.start(reservation, service.chat.render(reservation.messages), sink)
    while not sink.settled.wait(0 if service.has_work() else 0.01):
        if service.has_work():
            service.step()
        steps += 1  # an idle engine waits for the answers like a stepping one
        due = [request for at, request in sent if steps - at >= delay]
        sent[:] = [(at, request) for at, request in sent if steps - at < delay]
        for request in due:
            service.apply_text(DetokenizeReply(tuple(map(service.chat.follow, request.pieces))))
    assert sink.reply is not None, sink.refused
    return sink.reply


def test_a_stop_string_ends_the_turn_at_the_same_token_however_late_its_text_comes(
    service,
) -> None:
    """The turn's tokens, its text, the stored log and the next turn are the same whether the
    tokenizer answers at once or five steps late, when the engine has sampled tokens past the
    stop string already (they are discarded with their KV)."""
    body = {"message": CHAT[0], "max_tokens": 40, "ignore_eos": True}
    full = late_turn(service, 0, **body)
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert stop.strip() and text.count(stop) == 1, text
    decode = service.chat.decode
    completes = next(n for n in range(1, 41) if stop in decode(full["token_ids"][:n]))
    runs = []
    for delay in (0, 2, 5):
        # each run with a cache salt of its own: no run finds another's chunks by content
        salt = {"cache_salt": f"run {delay}"}
        first = late_turn(service, delay, **body, **salt, stop=[stop], stream=delay == 2)
        conv_id = first["conversation_id"]
        second = late_turn(
            service, delay, conversation_id=conv_id, message=CHAT[1], max_tokens=12, **salt
        )
        log = service.store.token_log(conv_id)
        runs.append((first, second, log))
    for first, second, log in runs:
        assert first["token_ids"] == full["token_ids"][:completes]
        assert first["text"] == text[: text.index(stop)] and first["finish_reason"] == "stop"
        assert log == runs[0][2]
        assert second["token_ids"] == runs[0][1]["token_ids"]
        assert second["usage"] == runs[0][1]["usage"]  # the same history kept, from the GPU
    assert runs[0][1]["usage"]["prompt_sources"]["gpu"] > 0


SYSTEM = {"role": "system", "content": "You answer in one word."}


def test_a_conversation_keeps_its_system_message_when_loaded_from_the_store(service) -> None:
    """The chat a first turn was sent whole with (a system message before the user's) is stored
    with the turn, so a conversation loaded again (after a restart) renders it as before."""
    first = turn(service, messages=[SYSTEM, {"role": "user", "content": CHAT[0]}]).reply
    assert first is not None
    conv_id = first["conversation_id"]
    live = service.reserve(parse_chat(orjson.dumps({"conversation_id": conv_id, "message": "x"})))
    service.release(live)
    service.conversations.clear()  # as after a restart: only the store knows it
    loaded = service.reserve(parse_chat(orjson.dumps({"conversation_id": conv_id, "message": "x"})))
    assert loaded.messages == live.messages and loaded.messages[0] == SYSTEM
    service.release(loaded)
    (summary,) = service.get(conv_id).turns
    assert summary.history is not None and [t.content for t in summary.history] == [
        SYSTEM["content"]
    ]


def test_a_created_conversation_starts_from_its_messages(service) -> None:
    """`create` makes a conversation with no turn; its first turn continues the messages it was
    made with, from memory or, after a restart, from the store; that turn's record holds them."""
    opening = [
        SYSTEM,
        {"role": "user", "content": CHAT[0]},
        {"role": "assistant", "content": "Paris"},
    ]
    conv_id, created = service.create(opening, None)
    created.result(30)
    got = service.get(conv_id)
    assert (got.num_turns, [t.content for t in got.opening]) == (0, [m["content"] for m in opening])
    service.conversations.clear()
    reservation = service.reserve(
        parse_chat(orjson.dumps({"conversation_id": conv_id, "message": CHAT[1]}))
    )
    assert reservation.messages == [*opening, {"role": "user", "content": CHAT[1]}]
    service.release(reservation)
    reply = turn(service, conversation_id=conv_id, message=CHAT[1]).reply
    assert reply is not None and reply["turn"] == 0
    assert service.store.turns(conv_id)[0].history == tuple(opening)
    assert service.store.meta(conv_id).opening == ()  # type: ignore[union-attr]
    with pytest.raises(ApiError) as other:
        service.get(conv_id, tenant="bob")
    assert other.value.code == "not_found"
