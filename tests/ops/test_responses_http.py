"""OpenAI's Responses and Conversations APIs end to end with the official `openai` client: a real
`pensieve serve --http-port` process with its nats-server and accounts, tenants made by
`pensieve tenant add`, the real SmolLM2 on the CPU. Greedy replies are compared with the chat
completions of the same chat, which the other HTTP tests check against the engine."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.ops.http_server import MODEL, Server, serving

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_output_tokens": 16}
SYSTEM = "You answer in one short sentence."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("data")
    with serving(data, "--gpu-cache-tokens", "8192", "--cpu-cache-tokens", "2048") as running:
        yield running


@pytest.fixture(scope="module")
def alice(server) -> OpenAI:
    return server.client("alice")


@pytest.fixture(scope="module")
def bob(server) -> OpenAI:
    return server.client("bob")


def completed(api: OpenAI, messages: list[dict[str, str]]) -> str:
    """The greedy chat completion of `messages`, as long as a response's."""
    done = api.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=GREEDY["max_output_tokens"]
    )
    return done.choices[0].message.content or ""


def texts(api: OpenAI, conv_id: str) -> list[tuple[str, str]]:
    """A conversation's items, in order, as (role, text)."""
    items = api.conversations.items.list(conv_id, order="asc", limit=100)
    return [(item.role, "".join(part.text for part in item.content)) for item in items]


def test_a_response_is_the_chat_completion_of_the_same_turn(alice) -> None:
    first = alice.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.output_text == completed(alice, [{"role": "user", "content": QUESTION}])
    usage = first.usage
    assert usage is not None and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0


def test_two_turns_through_previous_response_id_reuse_the_kv(alice) -> None:
    first = alice.responses.create(model=MODEL, input="Name a large animal.", **GREEDY)
    second = alice.responses.create(
        model=MODEL, input="And a small one?", previous_response_id=first.id, **GREEDY
    )
    assert second.previous_response_id == first.id
    assert second.conversation is not None and first.conversation is not None
    assert second.conversation.id == first.conversation.id  # the next turn of the same one
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    chat = [
        {"role": "user", "content": "Name a large animal."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a small one?"},
    ]
    assert second.output_text == completed(alice, chat)
    again = alice.responses.retrieve(second.id)
    assert (again.id, again.output_text, again.status) == (
        second.id,
        second.output_text,
        second.status,
    )
    assert again.usage == second.usage
    added = alice.responses.input_items.list(second.id, order="asc")
    assert [(i.role, i.content[0].text) for i in added] == [("user", "And a small one?")]


def test_a_streamed_response_sends_the_events_the_client_parses(alice) -> None:
    question = "What is the capital of Italy?"
    whole = alice.responses.create(model=MODEL, input=question, **GREEDY)
    events = list(alice.responses.create(model=MODEL, input=question, stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response  # type: ignore[union-attr]
    assert deltas == last.output_text == whole.output_text
    assert events[0].response.id == last.id  # type: ignore[union-attr]
    assert alice.responses.retrieve(last.id).output_text == deltas
    assert last.usage is not None and last.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


def test_a_response_to_an_earlier_one_branches_with_its_history(alice) -> None:
    first = alice.responses.create(model=MODEL, input="Name a colour.", **GREEDY)
    second = alice.responses.create(
        model=MODEL, input="And another one?", previous_response_id=first.id, **GREEDY
    )
    branch = alice.responses.create(
        model=MODEL, input="Name a fruit of that colour.", previous_response_id=first.id, **GREEDY
    )
    assert branch.conversation.id != first.conversation.id  # type: ignore[union-attr]
    chat = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name a fruit of that colour."},
    ]
    assert branch.output_text == completed(alice, chat)
    assert texts(alice, branch.conversation.id) == [  # type: ignore[union-attr]
        *((m["role"], m["content"]) for m in chat),
        ("assistant", branch.output_text),
    ]
    # the shared prefix came from the cache, by content; the first conversation goes on
    assert branch.usage is not None and branch.usage.input_tokens_details.cached_tokens > 0
    assert alice.responses.retrieve(second.id).output_text == second.output_text
    third = alice.responses.create(
        model=MODEL, input="One more?", previous_response_id=second.id, **GREEDY
    )
    assert third.conversation.id == first.conversation.id  # type: ignore[union-attr]


def test_two_responses_to_the_latest_one_at_once_both_answer_and_one_branches(alice) -> None:
    first = alice.responses.create(model=MODEL, input="Name a colour.", **GREEDY)
    asked = ("And another one?", "Name a fruit of that colour.")
    with ThreadPoolExecutor(len(asked)) as pool:  # both plan the same next turn of it
        sent = [
            pool.submit(
                alice.responses.create,
                model=MODEL,
                input=question,
                previous_response_id=first.id,
                **GREEDY,
            )
            for question in asked
        ]
        answered = [future.result() for future in sent]
    kept = {r.conversation.id for r in answered}  # type: ignore[union-attr]
    assert len(kept) == 2 and first.conversation.id in kept  # type: ignore[union-attr]
    before = [("user", "Name a colour."), ("assistant", first.output_text)]
    for question, response in zip(asked, answered, strict=True):
        chat = texts(alice, response.conversation.id)  # type: ignore[union-attr]
        assert chat == [*before, ("user", question), ("assistant", response.output_text)]


def test_a_response_not_stored_cannot_be_retrieved(alice) -> None:
    first = alice.responses.create(model=MODEL, input="Name a river.", **GREEDY)
    unstored = alice.responses.create(
        model=MODEL, input="And a lake?", previous_response_id=first.id, store=False, **GREEDY
    )
    assert unstored.output_text and unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    # the stored conversation it followed is untouched: its next turn is still the second
    after = alice.responses.create(
        model=MODEL, input="And a lake?", previous_response_id=first.id, **GREEDY
    )
    assert after.output_text == unstored.output_text
    assert after.id.startswith("resp_1_")


def test_a_deleted_response_is_gone(alice) -> None:
    made = alice.responses.create(model=MODEL, input="Name a mountain.", **GREEDY)
    assert alice.responses.retrieve(made.id).output_text == made.output_text
    alice.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(made.id)


def test_input_items_and_instructions_make_the_chat(alice) -> None:
    items: list[Any] = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": [{"type": "input_text", "text": "And of Italy?"}]},
    ]
    made = alice.responses.create(model=MODEL, input=items, instructions=SYSTEM, **GREEDY)
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert made.instructions == SYSTEM and made.output_text == completed(alice, chat)
    # the next turn keeps the system message (it is the conversation's), and its KV
    follow = alice.responses.create(
        model=MODEL, input="And of Spain?", previous_response_id=made.id, **GREEDY
    )
    chat += [
        {"role": "assistant", "content": made.output_text},
        {"role": "user", "content": "And of Spain?"},
    ]
    assert follow.output_text == completed(alice, chat)
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0


def test_another_tenants_response_is_not_found(alice, bob) -> None:
    made = alice.responses.create(model=MODEL, input="Name a city.", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=MODEL, input="Hi", previous_response_id=made.id, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        bob.conversations.retrieve(made.conversation.id)  # type: ignore[union-attr]
    assert alice.responses.retrieve(made.id).output_text == made.output_text


def test_conversations_are_created_continued_listed_and_deleted(alice, bob) -> None:
    opening: list[Any] = [{"type": "message", "role": "system", "content": SYSTEM}]
    conversation = alice.conversations.create(items=opening)
    assert alice.conversations.retrieve(conversation.id).id == conversation.id
    first = alice.responses.create(
        model=MODEL, input="Name a planet.", conversation=conversation.id, **GREEDY
    )
    second = alice.responses.create(
        model=MODEL, input="And a star?", conversation=conversation.id, **GREEDY
    )
    assert second.conversation.id == conversation.id  # type: ignore[union-attr]
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    expected = [
        ("system", SYSTEM),
        ("user", "Name a planet."),
        ("assistant", first.output_text),
        ("user", "And a star?"),
        ("assistant", second.output_text),
    ]
    assert texts(alice, conversation.id) == expected
    page = alice.conversations.items.list(conversation.id, limit=2, order="asc")
    assert len(page.data) == 2 and page.has_more
    rest = alice.conversations.items.list(conversation.id, after=page.data[-1].id, order="asc")
    assert [item.role for item in rest.data] == ["user", "assistant", "user", "assistant"][1:]
    newest = alice.conversations.items.list(conversation.id, limit=1)  # desc by default
    assert newest.data[0].content[0].text == second.output_text  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        bob.conversations.items.list(conversation.id)
    with pytest.raises(openai.NotFoundError):
        bob.conversations.delete(conversation.id)
    deleted = alice.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.id == conversation.id
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


def test_what_the_engine_cannot_do_is_refused_naming_the_field(alice) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        alice.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}], **GREEDY)
    assert refused.value.body["param"] == "tools"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        alice.responses.create(
            model=MODEL, input=[{"role": "assistant", "content": "Hello"}], **GREEDY
        )
    assert refused.value.body["param"] == "input"  # type: ignore[index]
