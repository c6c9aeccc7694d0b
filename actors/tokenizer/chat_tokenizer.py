"""The tokenizer actor's core: chat template, encode, decode (no I/O).

A model with a smaller vocabulary than the tokenizer (random-weight presets used for speed) sees
token ids folded into its vocabulary; the benchmark only needs realistic lengths.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pensieve.actors.tokenizer.tool_parsers import ToolParser, parser_for
from pensieve.actors.wire.messages import ChatMessage, TextPiece, TextUpdate


class ToolsUnsupported(ValueError):
    """Tools asked of a model whose chat template does not show them."""


@dataclass
class ChatTokenizer:
    tokenizer: Any  # a transformers tokenizer with a chat template
    vocab_size: int  # the model's

    tool_parser_name: str | None = None  # `--tool-call-parser` (None: the template's)

    def render(
        self,
        messages: Sequence[ChatMessage],
        generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] = (),
        prefill: str = "",
    ) -> list[int]:
        """Token ids of the whole conversation, ending with the assistant's turn opening (or,
        without `generation_prompt`, with the last message: a prefix of later conversations),
        then `prefill`, the start of the reply. `tools` (function definitions) go to the
        template; one that shows no tools refuses them (`ToolsUnsupported`).

        Message text is tokenized as text: a control token's string in it (`<|im_start|>`, say)
        stays plain text, so no message can forge a turn of another role."""
        if tools and not self.shows_tools:
            raise ToolsUnsupported(
                "the model's chat template does not show tools to the model, so it cannot "
                "call them: serve it with a template that does (--chat-template)"
            )
        given = [_for_template(m) for m in messages]
        extra = {"tools": list(tools)} if tools else {}
        if any(s in m["content"] for m in given for s in self._special_strings):
            ids = self._render_in_segments(given, generation_prompt, extra)
        else:
            ids = self.tokenizer.apply_chat_template(
                given,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
                **extra,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older/newer return types
                ids = ids["input_ids"]
        if prefill:
            ids = [*ids, *self.tokenizer.encode(prefill, add_special_tokens=False)]
        return [int(t) % self.vocab_size for t in ids]

    @functools.cached_property
    def shows_tools(self) -> bool:
        """Whether the chat template writes tool definitions into the prompt: a template that
        ignores them renders the same text with and without one."""
        chat = [{"role": "user", "content": "?"}]
        tool = {"type": "function", "function": {"name": "probe_tool_x", "parameters": {}}}
        try:
            plain, shown = (
                self.tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=False, **extra
                )
                for extra in ({}, {"tools": [tool]})
            )
        except Exception:  # a template that refuses tools
            return False
        return bool(plain != shown)

    @functools.cached_property
    def tool_parser(self) -> ToolParser:
        """How this model writes tool calls (`tool_parsers.parser_for`)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return parser_for(template if isinstance(template, str) else None, self.tool_parser_name)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw completion's prompt: the text as it is, with no chat template,
        and the special tokens the tokenizer adds to any input (a beginning-of-sequence token,
        for some); control tokens' strings in it are the tokens (the client writes the whole
        prompt, as for vLLM's completions)."""
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        return [int(t) % self.vocab_size for t in ids]

    def _render_in_segments(
        self,
        messages: Sequence[ChatMessage],
        generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """The template rendered around placeholders, its own text tokenized with control tokens
        and each message's text without. Taken only when some message holds a control token's
        string: elsewhere one tokenization of the whole text keeps the ids transformers gives."""
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        rest = str(
            self.tokenizer.apply_chat_template(
                marked, add_generation_prompt=generation_prompt, tokenize=False, **(extra or {})
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


def _for_template(message: ChatMessage) -> ChatMessage:
    """A message as chat templates take it: text content (an assistant's that only calls
    tools has none), and each call's arguments as an object (OpenAI sends them as JSON text;
    the templates write them with `tojson`), as vLLM hands them over."""
    given = {**message, "content": message.get("content") or ""}
    if "tool_calls" in message:
        given["tool_calls"] = [_call_for_template(call) for call in message["tool_calls"]]
    return given


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    with contextlib.suppress(TypeError, ValueError):  # not JSON text: as it is
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def _first_stop(text: str, stops: Sequence[str], searched: int) -> int | None:
    """Where the first stop string that ends after `text[:searched]` begins in `text`."""
    hits = [i for s in stops if (i := text.find(s, max(0, searched - len(s) + 1))) >= 0]
    return min(hits, default=None)
