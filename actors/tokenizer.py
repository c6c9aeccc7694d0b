"""The tokenizer actor's core: chat template, encode, decode (no I/O).

A model with a smaller vocabulary than the tokenizer (random-weight presets used for speed) sees
token ids folded into its vocabulary; the benchmark only needs realistic lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ChatMessage = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass
class ChatTokenizer:
    tokenizer: Any  # a transformers tokenizer with a chat template
    vocab_size: int  # the model's

    def render(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of the whole conversation, ending with the assistant's turn opening."""
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older/newer return types
            ids = ids["input_ids"]
        return [int(t) % self.vocab_size for t in ids]

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
