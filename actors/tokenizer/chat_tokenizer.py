"""The tokenizer actor's core: chat template, encode, decode (no I/O).

A model with a smaller vocabulary than the tokenizer (random-weight presets used for speed) sees
token ids folded into its vocabulary; the benchmark only needs realistic lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pensieve.actors.wire.messages import ChatMessage, TextPiece, TextUpdate


@dataclass
class ChatTokenizer:
    tokenizer: Any  # a transformers tokenizer with a chat template
    vocab_size: int  # the model's

    def render(self, messages: Sequence[ChatMessage], generation_prompt: bool = True) -> list[int]:
        """Token ids of the whole conversation, ending with the assistant's turn opening (or,
        without `generation_prompt`, with the last message: a prefix of later conversations).

        Message text is tokenized as text: a control token's string in it (`<|im_start|>`, say)
        stays plain text, so no message can forge a turn of another role."""
        if any(s in m["content"] for m in messages for s in self._special_strings):
            return self._render_in_segments(messages, generation_prompt)
        ids = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older/newer return types
            ids = ids["input_ids"]
        return [int(t) % self.vocab_size for t in ids]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw completion's prompt: the text as it is, with no chat template,
        and the special tokens the tokenizer adds to any input (a beginning-of-sequence token,
        for some); control tokens' strings in it are the tokens (the client writes the whole
        prompt, as for vLLM's completions)."""
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        return [int(t) % self.vocab_size for t in ids]

    def _render_in_segments(
        self, messages: Sequence[ChatMessage], generation_prompt: bool = True
    ) -> list[int]:
        """The template rendered around placeholders, its own text tokenized with control tokens
        and each message's text without. Taken only when some message holds a control token's
        string: elsewhere one tokenization of the whole text keeps the ids transformers gives."""
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        rest = str(
            self.tokenizer.apply_chat_template(
                marked, add_generation_prompt=generation_prompt, tokenize=False
            )
        )
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

    def follow(self, piece: TextPiece) -> TextUpdate:
        """The text a reply's new tokens add, and whether a stop string ends the reply (see
        `TextPiece`). Tokens are taken one at a time, so a stop string ends the reply at the
        exact token that completes it however its tokens were grouped into pieces: the reply,
        and so the next turn, never depend on timing. Each token decodes only the short window
        from `prefix` on, so a piece costs the same at any reply length. A character split over
        several tokens (multi-byte UTF-8, byte-fallback pieces) waits until it is whole."""
        decode = self._decode_window
        ids, start = piece.ids, piece.start
        prefix, read = piece.prefix, piece.read
        found = piece.tail  # what is searched for stop strings: the tail, then the new text
        stop_at: int | None = None
        shown: str | None = None  # the text of ids [prefix, read)
        for end in range(read + 1, start + len(ids) + 1):
            if shown is None:
                shown = decode(ids[prefix - start : read - start])
            text = decode(ids[prefix - start : end - start])
            if len(text) <= len(shown) or text.endswith("\ufffd"):
                continue  # a special token, or an unfinished character: wait for more
            searched = len(found)
            found += text[len(shown) :]
            prefix, read, shown = read, end, None
            hit = _first_stop(found, piece.stop, searched)
            if hit is not None:
                found, stop_at = found[:hit], end
                break
        base = len(piece.tail)
        trim, added = max(base - len(found), 0), found[base:]
        whole = None
        if piece.final:  # the reply's text is its tokens decoded whole, not the pieces joined
            count = start + len(ids) if stop_at is None else stop_at
            whole = self.decode(ids[:count])
            hit = _first_stop(whole, piece.stop, 0)
            if hit is not None:
                whole, stop_at = whole[:hit], count
        return TextUpdate(piece.key, added, trim, prefix, read, stop_at, whole)

    @functools.cached_property
    def _decode_window(self) -> Callable[[Sequence[int]], str]:
        """`decode` for the few ids of a window, straight through the Rust tokenizer where that
        gives the same text (no clean-up of spaces): it is called twice a token."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return self.decode
        return lambda ids: str(backend.decode(list(ids), skip_special_tokens=True))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.tokenizer.eos_token_id
        return frozenset() if eos is None else frozenset({int(eos) % self.vocab_size})


def _first_stop(text: str, stops: Sequence[str], searched: int) -> int | None:
    """Where the first stop string that ends after `text[:searched]` begins in `text`."""
    hits = [i for s in stops if (i := text.find(s, max(0, searched - len(s) + 1))) >= 0]
    return min(hits, default=None)
