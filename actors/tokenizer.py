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

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.tokenizer.eos_token_id
        return frozenset() if eos is None else frozenset({int(eos) % self.vocab_size})
