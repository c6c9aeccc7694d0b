"""The --public-prompts file: read as JSON or JSON Lines, rendered with the real SmolLM2 chat
template, keyed in the public namespace; a file that cannot be used is refused with a clear
message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.chunk_keys import Namespace, keys_of, namespace, public_seed
from pensieve.models.assets import smollm2_tokenizer
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.public_prompts import PublicPromptsError, public_keys, read_public_prompts

MODEL = "smollm2|seed=0|float32"
SYSTEM = {"role": "system", "content": "You plan trips. " + "Use the tool search(city). " * 40}
TOOLS = {"role": "system", "content": "You call tools. " + "Use the tool weather(city). " * 40}


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    tokenizer = smollm2_tokenizer()
    return ChatTokenizer(tokenizer, len(tokenizer))


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_the_keys_are_those_of_each_prompts_full_chunks_as_a_turn_renders_them(tmp_path, chat):
    path = write(tmp_path / "public.json", json.dumps([[SYSTEM], [TOOLS]]))
    public = public_keys(path, chat, MODEL, 32)
    question = {"role": "user", "content": "Where to in May?"}
    turn = chat.render([SYSTEM, question])
    prefix = chat.render([SYSTEM], generation_prompt=False)
    assert turn[: len(prefix)] == prefix and len(prefix) >= 200
    public_chunks = len(prefix) // 32
    expected = keys_of(public_seed(MODEL), prefix, 32)
    assert Namespace(namespace(MODEL, "acme"), public).keys_of(turn, 32)[:public_chunks] == expected
    tools = chat.render([TOOLS], generation_prompt=False)
    assert public.keys == set(expected) | set(keys_of(public_seed(MODEL), tools, 32))


def test_json_lines_name_one_prompt_a_line(tmp_path):
    lines = json.dumps([SYSTEM]) + "\n\n" + json.dumps([TOOLS, {"role": "user", "content": "Hi"}])
    prompts = read_public_prompts(write(tmp_path / "public.jsonl", lines + "\n"))
    assert prompts == [[SYSTEM], [TOOLS, {"role": "user", "content": "Hi"}]]


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("missing.json", None, "cannot read it"),
        ("bad.json", "[[{", "is not JSON"),
        ("object.json", json.dumps({"messages": [SYSTEM]}), "Expected `array`"),
        ("role.json", json.dumps([[{"role": "tool", "content": "x"}]]), "role"),
        ("none.json", "[]", "names no prompt"),
        ("empty.json", "[[]]", "prompt 1 has no message, or an empty one"),
        ("blank.json", json.dumps([[SYSTEM], [{"role": "system", "content": ""}]]), "prompt 2"),
        ("bad.jsonl", json.dumps([SYSTEM]) + "\n[{", "line 2 is not JSON"),
        ("short.json", json.dumps([[SYSTEM], [{"role": "system", "content": "Hi"}]]), "shorter"),
    ],
)
def test_a_file_that_cannot_be_used_is_refused_saying_why(tmp_path, chat, name, text, says):
    path = tmp_path / name if text is None else write(tmp_path / name, text)
    with pytest.raises(PublicPromptsError, match=str(path)) as refused:
        public_keys(path, chat, MODEL, 32)
    assert says in str(refused.value)


def test_public_prompts_need_prefix_sharing():
    with pytest.raises(ValueError, match="needs prefix sharing"):
        EngineOptions(model="smollm2", prefix_sharing=False, public_prompts="public.json")
