"""A turn in flight: from its start on the engine to its reply (data), and its sampling."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import trace

from pensieve.actors.scheduler.conversations import Conversation
from pensieve.actors.scheduler.request import Request
from pensieve.actors.tokenizer.tool_parsers import ToolCall, ToolParser
from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.schemas import ApiError, ChatRequest
from pensieve.actors.wire.step import SamplingParams


class TurnSink(Protocol):
    """Where a turn's output goes; called from the engine or store-writer thread."""

    def delta(self, text: str, tokens: int) -> None: ...  # `tokens`: output tokens shown so far
    def done(self, reply: dict[str, Any]) -> None: ...
    def error(self, error: ApiError) -> None: ...


@dataclass
class Turn:
    conv: Conversation
    request: Request
    messages: list[ChatMessage]  # this turn's chat, without the reply
    sink: TurnSink
    stream: bool
    stop: tuple[str, ...]
    started_at: float
    span: trace.Span
    followed: bool  # streamed or with stop strings: its text is found as its tokens come
    final: bool = False  # the conversation ends with this turn
    # when to end it early (time.monotonic()): its timeout, or at once once its requester
    # cancelled it (None: it runs to its end)
    cancel_at: float | None = None
    # its text, found by the tokenizer actor: the text so far, where the last answer left off
    # (`TextPiece`), how many output tokens were sent, whether a piece is out now
    text: str = ""
    prefix: int = 0
    read: int = 0
    fed: int = 0
    asking: bool = False
    sent: int = 0  # characters of text already streamed
    ended: bool = False  # the engine is done with it: its final text is being found
    whole: str | None = None  # the reply's final text
    # tool calls read from the reply (None: its text is not read for calls)
    tool_parser: ToolParser | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # those found in the reply
    # what its request asked the reply to be, for its record (`ChatRequest.structure`)
    structure: dict[str, Any] = field(default_factory=dict)
    holdback: int = field(init=False)

    def __post_init__(self) -> None:  # a streamed delta never reveals a stop string's beginning
        self.holdback = max((len(s) for s in self.stop), default=1) - 1


def sampling_of(
    request: ChatRequest, conv: Conversation, prompt: list[int], max_context: int, vocab_size: int
) -> SamplingParams:
    """The turn's sampling; raises ApiError if the prompt cannot be taken."""
    ids = request.prompt if isinstance(request.prompt, tuple) else ()  # given by the client
    if ids and max(ids) >= vocab_size:
        raise ApiError(
            "invalid_request",
            f"'prompt' holds token ids outside the model's vocabulary (0 to {vocab_size - 1})",
        )
    if request.logit_bias and request.logit_bias[-1][0] >= vocab_size:
        raise ApiError(
            "invalid_request",
            f"'logit_bias' names token ids outside the model's vocabulary (0 to {vocab_size - 1})",
            "logit_bias",
        )
    room = max_context - len(prompt)
    if room < 1:
        raise ApiError(
            "too_long",
            f"the prompt has {len(prompt)} tokens; the model's context holds {max_context}",
        )
    seed = request.seed
    if seed is None and request.temperature > 0:
        seed = zlib.crc32(f"{conv.conv_id}:{conv.turns}:{time.time_ns()}".encode())
    return SamplingParams(
        max_tokens=min(request.max_tokens, room),
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        min_tokens=min(request.min_tokens, request.max_tokens, room),
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=request.logit_bias,
        seed=seed,
        ignore_eos=request.ignore_eos,
        grammar=request.grammar,
    )
