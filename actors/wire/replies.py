"""The replies of the client API (`pensieve.v1.*`) as the engine sends them: a turn's whole
reply and its streamed deltas, with its usage and where its prompt's KV came from, and the
answers of the conversation requests. A refusal is `schemas.ErrorReply`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from pensieve.actors.wire.schemas import (
    ChatTurn,
    ToolCall,
    ToolChoice,
    ToolDef,
    ToolResult,
)
from pensieve.actors.wire.structured import ResponseFormat

REUSED = ("gpu", "cpu", "disk")  # the tiers whose tokens `cached_tokens` counts


class PromptSources(msgspec.Struct, frozen=True):
    """Where the KV of each prompt token came from: `gpu` found in the GPU tier, `cpu` swapped
    in from the CPU tier, `disk` read back from the disk tier, `recomputed` from the token log
    (its KV was in no tier), `new` computed for the first time; these five add up to
    `prompt_tokens`. `shared`: of `gpu` and `cpu`, those found by content in chunks another
    conversation computed (a common prefix)."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    recomputed: int = 0
    new: int = 0
    shared: int = 0

    @property
    def cached(self) -> int:
        """The prompt tokens whose KV was reused, from any tier: `gpu + cpu + disk` (a shared
        chunk is counted in its tier; recomputed tokens were computed again)."""
        return self.gpu + self.cpu + self.disk

    @classmethod
    def total(cls, many: Sequence[Mapping[str, int]]) -> PromptSources:
        """The sum of `prompt_sources` objects as a reply has them (a key left out counts 0)."""
        return cls(**{k: sum(found.get(k, 0) for found in many) for k in cls.__struct_fields__})


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of `prompt_tokens`, those whose KV was reused (`PromptSources.cached`)
    prompt_sources: PromptSources  # every prompt token by where its KV came from


class ChatReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The answer to a chat turn (streamed: the last message, with `done`)."""

    conversation_id: str
    turn: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "tool_calls", "cancelled" or "abort"
    usage: Usage
    final: bool = False  # said only when true: the conversation has ended
    done: bool = False  # said only when streamed
    # the calls read from the reply (said only when there are some; `text` is what came
    # before them)
    tool_calls: tuple[ToolCall, ...] = ()


class ChatDelta(msgspec.Struct, frozen=True):
    """A streamed turn's new text; the id lets a new conversation's turn be cancelled.
    `completion_tokens`: the reply's tokens whose text has gone out so far (a delta may carry
    several tokens, e.g. the bytes of one character), as vLLM's continuous usage stats."""

    delta: str
    conversation_id: str
    completion_tokens: int = 0


class DeleteReply(msgspec.Struct, frozen=True):
    conversation_id: str
    deleted: bool


class CancelReply(msgspec.Struct, frozen=True):
    conversation_id: str
    cancelled: bool  # False: no turn of it was running


class TurnSummary(msgspec.Struct, frozen=True, omit_defaults=True):
    """One stored turn of a conversation, as `conversations.get` lists it."""

    turn: int
    message: str  # the user's ("" in a turn that only answered tool calls)
    text: str  # the reply's
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    # the chat before `message`, where it is not the turns' before it (`TurnRecord.history`)
    history: list[ChatTurn] | None = None
    cached_tokens: int = 0  # of `prompt_tokens`, those whose KV was reused, as in `Usage`
    prompt_sources: PromptSources | None = None  # as in `Usage`
    started_at: float = 0.0  # unix time
    tool_results: tuple[ToolResult, ...] = ()  # said only when there are some
    tool_calls: tuple[ToolCall, ...] = ()  # the reply's, said only when there are some
    # what the reply was asked to be, said only where the turn's request gave it
    response_format: ResponseFormat | None = None
    tools: tuple[ToolDef, ...] = ()
    tool_choice: ToolChoice = "none"


class ConversationReply(msgspec.Struct, frozen=True):
    """`pensieve.v1.conversations.get`: a page of the conversation's turns; `next_cursor`
    continues, None at the end."""

    conversation_id: str
    turns: list[TurnSummary]
    num_tokens: int  # in its token log
    num_turns: int
    busy: bool  # a turn of it is running
    ended: bool  # a final turn ended it
    next_cursor: str | None
    created_at: float = 0.0  # unix time
    opening: list[ChatTurn] = []  # the messages it was created with, until its first turn


class CreateReply(msgspec.Struct, frozen=True):
    """`pensieve.v1.conversations.create`: the new conversation's id."""

    conversation_id: str


class ListReply(msgspec.Struct, frozen=True):
    """`pensieve.v1.conversations.list`: a page of the tenant's conversation ids, in the store's
    order, from one engine; `next_cursor` continues, None at the end."""

    conversations: list[str]
    next_cursor: str | None
    engine_id: str = ""


def chat_reply(
    conv_id: str,
    turn: int,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    prompt_tokens: int,
    sources: PromptSources,
    final: bool = False,
    tool_calls: tuple[dict[str, Any], ...] = (),
) -> dict[str, Any]:
    """A `ChatReply` as a dict (the scheduler adds `done` to a streamed one); `tool_calls` in
    OpenAI's shape."""
    usage = Usage(prompt_tokens, len(token_ids), sources.cached, sources)
    calls = msgspec.convert(tool_calls, tuple[ToolCall, ...])
    reply = ChatReply(conv_id, turn, text, token_ids, finish_reason, usage, final, tool_calls=calls)
    built: dict[str, Any] = msgspec.to_builtins(reply)
    return built
