"""The prompts an operator names public (`--public-prompts FILE`): read, checked, and keyed.

FILE is JSON, a list of prompts, or JSON Lines (`.jsonl`), one prompt a line; a prompt is a
list of OpenAI-style messages (`{"role": "system", "content": "..."}`), typically one system
message with tool definitions. Each is rendered with the model's chat template, without the
assistant's turn opening, and the keys of its full chunks are computed in the public namespace
(`chunk_keys.PublicKeys`): any tenant's turn whose prompt begins with those chunks shares them.
A file that cannot be read, a prompt with no message or an empty one, and a prompt shorter than
one chunk (nothing of it could be shared) are refused at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.chunk_keys import PublicKeys
from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.schemas import ChatTurn


class PublicPromptsError(ValueError):
    """The --public-prompts file cannot be used; the message says why."""


def read_public_prompts(path: Path) -> list[list[ChatMessage]]:
    """The prompts of `path`, each a non-empty list of messages with text."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PublicPromptsError(f"--public-prompts {path}: cannot read it: {error}") from None
    if path.suffix == ".jsonl":
        lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        prompts = [_decode(path, line, tuple[ChatTurn, ...], f"line {i}") for i, line in lines]
    else:
        prompts = list(_decode(path, text, tuple[tuple[ChatTurn, ...], ...], "the file"))
    if not prompts:
        raise PublicPromptsError(f"--public-prompts {path}: it names no prompt")
    for number, prompt in enumerate(prompts, 1):
        if not prompt or any(not turn.content for turn in prompt):
            raise PublicPromptsError(
                f"--public-prompts {path}: prompt {number} has no message, or an empty one"
            )
    return [[{"role": t.role, "content": t.content} for t in prompt] for prompt in prompts]


def public_keys(path: Path, chat: ChatTokenizer, model_id: str, block_size: int) -> PublicKeys:
    """The keys of the full chunks of the prompts of `path`, rendered by `chat`."""
    rendered = [chat.render(p, generation_prompt=False) for p in read_public_prompts(path)]
    for number, ids in enumerate(rendered, 1):
        if len(ids) < block_size:
            raise PublicPromptsError(
                f"--public-prompts {path}: prompt {number} is {len(ids)} tokens, shorter than "
                f"one {block_size}-token chunk: nothing of it could be shared"
            )
    return PublicKeys.of(model_id, rendered, block_size)


def _decode(path: Path, text: str, kind: Any, where: str) -> Any:
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as error:
        raise PublicPromptsError(f"--public-prompts {path}: {where}: {error}") from None
    except msgspec.DecodeError as error:
        raise PublicPromptsError(f"--public-prompts {path}: {where} is not JSON: {error}") from None
