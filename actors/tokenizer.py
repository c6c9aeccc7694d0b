"""The tokenizer actor's core: chat template, encode, decode (no I/O).

A model with a smaller vocabulary than the tokenizer (random-weight presets used for speed) sees
token ids folded into its vocabulary; the benchmark only needs realistic lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ChatMessage = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass
class ChatTokenizer:
    tokenizer: Any  # a transformers tokenizer with a chat template
    vocab_size: int  # the model's

    def render(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of the whole conversation, ending with the assistant's turn opening.

        Message text is tokenized as text: a control token's string in it (`<|im_start|>`, say)
        stays plain text, so no message can forge a turn of another role."""
        if any(s in m["content"] for m in messages for s in self._special_strings):
            return self._render_in_segments(messages)
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older/newer return types
            ids = ids["input_ids"]
        return [int(t) % self.vocab_size for t in ids]

    def _render_in_segments(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The template rendered around placeholders, its own text tokenized with control tokens
        and each message's text without. Taken only when some message holds a control token's
        string: elsewhere one tokenization of the whole text keeps the ids transformers gives."""
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        rest = str(self.tokenizer.apply_chat_template(
            marked, add_generation_prompt=True, tokenize=False
        ))  # fmt: skip
        ids: list[int] = []
        for message, mark in zip(messages, marks, strict=True):
            if mark not in rest:  # a message the template leaves out
                continue
            template, _, rest = rest.partition(mark)
            ids += self.tokenizer.encode(template, add_special_tokens=False)
            ids += self.tokenizer.encode(
                message["content"], add_special_tokens=False, split_special_tokens=True
            )
        ids += self.tokenizer.encode(rest, add_special_tokens=False)
        return [int(t) % self.vocab_size for t in ids]

    @functools.cached_property
    def _special_strings(self) -> tuple[str, ...]:
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).values()
        strings = {t.content for t in added if getattr(t, "special", False)}
        strings.update(getattr(self.tokenizer, "all_special_tokens", []))
        return tuple(sorted(s for s in strings if s))

    def encode(self, text: str) -> list[int]:
        return [
            int(t) % self.vocab_size for t in self.tokenizer.encode(text, add_special_tokens=False)
        ]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def text_stream(self) -> TextStream:
        """A follower of one growing reply: the text of each new token costs O(1), not a decode
        of the whole reply (see `TextStream`)."""
        return TextStream(self)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.tokenizer.eos_token_id
        return frozenset() if eos is None else frozenset({int(eos) % self.vocab_size})


class TextStream:
    """The text of a reply as its tokens arrive.

    `push(ids)` takes the reply's token ids so far and returns the text they add. A character
    split over several tokens (multi-byte UTF-8, byte-fallback pieces) waits until it is whole.
    With a fast tokenizer this is the `tokenizers` library's `DecodeStream` (Rust, a few
    microseconds a token: it decodes only a short window of the latest tokens); a tokenizer
    without a Rust backend decodes the whole reply each time, which is correct but quadratic, and
    so does a stream from the moment `DecodeStream` refuses its tokens (it raises on some
    sequences of byte pieces that are not valid UTF-8).
    """

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self.text = ""  # everything returned so far
        self._fed = 0  # token ids consumed
        self._backend = getattr(chat.tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        new_ids = token_ids[self._fed :]
        self._fed = len(token_ids)
        added = None
        if self._stream is not None:
            try:
                pieces = [self._stream.step(self._backend, int(t)) for t in new_ids]
                added = "".join(p for p in pieces if p)
            except Exception:  # it refuses some invalid byte sequences: decode whole from here
                self._stream = None
        if added is None:
            whole = self.chat.decode(token_ids)
            end = len(whole.rstrip("\ufffd"))  # an unfinished character waits
            added = whole[len(self.text) : end] if end > len(self.text) else ""
        self.text += added
        return added
