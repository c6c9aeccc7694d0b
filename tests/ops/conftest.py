"""Shared fixtures for end-to-end tests: the real SmolLM2 model, loaded once per session, and small
real ShareGPT workloads (messages shortened so a 2-core CPU replays them in seconds)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.models.loader import LoadedModel, load_model
from pensieve.ops.sharegpt import Conversation, Message, Role, load_conversations, write_jsonl


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2", "cpu", torch.float32)


@pytest.fixture(scope="session")
def smollm2_chat(smollm2: LoadedModel) -> ChatTokenizer:
    return ChatTokenizer(smollm2.tokenizer, smollm2.config.vocab_size)


def short_sharegpt(num: int, max_turns: int, max_chars: int) -> list[Conversation]:
    """The first `num` multi-turn ShareGPT conversations, each message cut to `max_chars`."""
    chosen = []
    for conv in load_conversations("sharegpt", 400):
        turns = [dataclasses.replace(m, text=m.text[:max_chars]) for m in conv.turns]
        if sum(m.role is Role.HUMAN for m in turns) < 2 or any(not m.text for m in turns):
            continue
        chosen.append(Conversation(conv.id, _first_human_turns(turns, max_turns)))
        if len(chosen) == num:
            return chosen
    raise AssertionError("not enough multi-turn conversations")


def _first_human_turns(turns: list[Message], max_turns: int) -> tuple[Message, ...]:
    kept: list[Message] = []
    for message in turns:
        if message.role is Role.HUMAN and sum(m.role is Role.HUMAN for m in kept) == max_turns:
            break
        kept.append(message)
    return tuple(kept)


@pytest.fixture(scope="session")
def sharegpt20(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sharegpt20.jsonl"
    write_jsonl(short_sharegpt(20, max_turns=3, max_chars=160), path)
    return path
