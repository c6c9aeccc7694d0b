"""The index of stateless chats: a chat that continues an answered one finds its conversation,
per tenant, and the oldest are forgotten first."""

from __future__ import annotations

from typing import Any

from pensieve.actors.ingress.chat_index import ChatIndex

Q1, Q2, Q3 = ({"role": "user", "content": q} for q in ("Hi", "And?", "So?"))


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_a_chat_that_continues_an_answered_one_finds_its_conversation() -> None:
    index = ChatIndex()
    assert index.find(None, [Q1]) is None
    index.remember("alice", [Q1], reply("Hello"), "c-1")
    assert index.find("alice", [Q1, reply("Hello"), Q2]) == "c-1"
    index.remember("alice", [Q1, reply("Hello"), Q2], reply("Well"), "c-1")
    assert index.find("alice", [Q1, reply("Hello"), Q2, reply("Well"), Q3]) == "c-1"
    # another reply, another tenant, or the service's own: nothing to continue
    assert index.find("alice", [Q1, reply("Hullo"), Q2]) is None
    assert index.find("bob", [Q1, reply("Hello"), Q2]) is None
    assert index.find(None, [Q1, reply("Hello"), Q2]) is None


def test_the_least_recently_used_chats_go_first() -> None:
    index = ChatIndex(capacity=2)
    for i in range(3):
        index.remember(None, [Q1], reply(f"r{i}"), f"c-{i}")
    assert index.find(None, [Q1, reply("r0"), Q2]) is None
    assert index.find(None, [Q1, reply("r1"), Q2]) == "c-1"
    index.remember(None, [Q1], reply("r3"), "c-3")  # r1 was used since r2: r2 goes
    assert index.find(None, [Q1, reply("r2"), Q2]) is None
    assert index.find(None, [Q1, reply("r1"), Q2]) == "c-1"


def test_a_chat_that_answers_tool_calls_finds_the_conversation_that_made_them() -> None:
    index = ChatIndex()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = {"role": "assistant", "content": "", "tool_calls": [call]}
    index.remember(None, [Q1], called, "c-1")
    results = [
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "warm", "tool_call_id": "call_2"},
    ]
    assert index.find(None, [Q1, called, *results]) == "c-1"
    assert index.find(None, [Q1, called, *results, Q2]) == "c-1"  # the user's after them
    assert index.find(None, [Q1, reply(""), *results]) is None  # a reply without the calls
