"""The client API's messages (`pensieve.v1.*`): request and reply bodies as msgspec Structs.

A request body is parsed once, by the ingress (`request_parsing.py`): its types and ranges are
checked while it is decoded, then the rules that span fields; bad input raises `ApiError` with
one of the contract's codes and a message that says what is wrong. The same types give the
published JSON Schema (`actors/wire/json_schema.py`); nothing here touches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.structured import Grammar, ResponseFormat, grammar_of

# every error code, with the HTTP-like status the NATS service error header carries for it
ERROR_STATUS = {
    "invalid_request": 400,
    "not_found": 404,
    "conflict": 409,
    "too_long": 413,
    "overloaded": 429,
    "cancelled": 499,
    "unavailable": 503,
    "internal": 500,
}
ERROR_CODES = tuple(ERROR_STATUS)
ErrorCode = Literal[
    "invalid_request",
    "not_found",
    "conflict",
    "too_long",
    "overloaded",
    "cancelled",
    "unavailable",
    "internal",
]
ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 8
MAX_LOGIT_BIAS = 300  # tokens a request may bias, as OpenAI's API allows
MAX_TOKENS_LIMIT = 1 << 20
DEFAULT_MAX_TOKENS = 256  # a chat turn's reply length when the request gives none
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SEED = (1 << 63) - 1
MAX_PROMPT_TOKEN = (1 << 31) - 1  # a token id past the model's vocabulary is refused later
MAX_PAGE = 1000  # items one `list` or `get` answer holds at most
PAGE_BYTES = 512 << 10  # text one `get` answer holds at most (NATS's default payload: 1 MiB)

_ENCODER = msgspec.json.Encoder()


class ApiError(Exception):
    """A request the service refuses; `code` is one of `ERROR_CODES`, `param` the request's
    field at fault where one is (a dotted path: `response_format.json_schema.schema`)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return _ENCODER.encode(ErrorReply(ErrorBody(self.code, self.message, self.param)))  # type: ignore[arg-type]


# ---- requests --------------------------------------------------------------------------------

NonEmptyArray = msgspec.Meta(extra_json_schema={"minItems": 1})
NonEmptyText = msgspec.Meta(extra_json_schema={"minLength": 1})  # said after "exactly one"
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_TOKEN)]
StopString = Annotated[str, msgspec.Meta(min_length=1)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
MAX_CACHE_SALT = 256
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT)]


FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A call of one of the request's tools, in a reply or in an assistant message."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A message: an assistant's that only calls tools has no `content`; a tool's answers the
    call `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of its arguments
    strict: bool | None = None


class ToolDef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tool the model may call (OpenAI's shape: only functions)."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`tool_choice` that makes the reply a call of this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class ToolResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a tool answered to the call `tool_call_id` of the conversation's last reply."""

    tool_call_id: str
    content: str


class ChatBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`pensieve.v1.chat`: one turn. Exactly one of `message` (the next user message of
    `conversation_id`, or of a new conversation) and/or `tool_results` (the answers to the
    last reply's tool calls), `messages` (the whole chat, ending with the user's or a tool's:
    a stateless client) or `prompt` (a raw completion: text encoded as it is, or token ids; it
    continues no conversation and ends after the turn). `tools` go to the chat template;
    `tool_choice` is "auto" (the reply may call them), "none" (its text is not read for
    calls), "required" (the reply calls one of them) or names a function (the reply calls
    it); the last two are enforced by a grammar, as `response_format` is (JSON, JSON that a
    schema validates, a regular expression or a Lark grammar)."""

    conversation_id: str | None = None  # absent: a new conversation; the reply returns its id
    # absent, not null: one of the three is given
    message: Annotated[str, NonEmptyText] | UnsetType = UNSET
    messages: Annotated[tuple[ChatTurn, ...], NonEmptyArray] | UnsetType = UNSET
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)] = DEFAULT_MAX_TOKENS
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # 0: greedy
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None  # None: every token
    # a token less likely than min_p times the likeliest one is not sampled
    min_p: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    # vLLM's: no end-of-sequence or stop token is sampled before this many output tokens
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    # OpenAI's: a token sampled before is made less likely once (presence) and per time
    # sampled (frequency); negative values make it likelier
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    # token id (a string of digits, as in OpenAI's API) -> added to its logit
    logit_bias: (
        Annotated[
            dict[Annotated[str, msgspec.Meta(pattern="^[0-9]{1,9}$")], LogitBias],
            msgspec.Meta(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None = None
    stop: (
        StopString | Annotated[tuple[StopString, ...], msgspec.Meta(max_length=MAX_STOP_STRINGS)]
    ) = ()
    ignore_eos: bool = False
    stream: bool = False  # deltas to the reply inbox, then the reply with "done": true
    final: bool = False  # the conversation ends after this turn
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    prompt: (
        Annotated[str, NonEmptyText] | Annotated[tuple[TokenId, ...], NonEmptyArray] | UnsetType
    ) = UNSET
    # cached prefixes are shared only among turns of one tenant with one salt (none: the
    # tenant's turns without one)
    cache_salt: CacheSalt | None = None
    tools: tuple[ToolDef, ...] = ()
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    tool_results: Annotated[tuple[ToolResult, ...], NonEmptyArray] | UnsetType = UNSET
    response_format: ResponseFormat | None = None
    # the number the client expects this turn to get (the reply's `turn`): a turn sent again
    # after a lost reply is then refused `conflict` rather than committed twice
    turn: Annotated[int, msgspec.Meta(ge=0)] | None = None


class ChatRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A chat turn as the ingress checked it: the stop strings a tuple, `messages` as the chat
    template takes them, `final` set for a raw completion."""

    conversation_id: str | None  # None: a new conversation
    message: str | None  # the next user message (stateful client)
    messages: tuple[ChatMessage, ...] | None  # the whole chat (stateless client)
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by token id
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    final: bool = False  # the conversation ends after this turn
    timeout_s: float | None = None  # cancelled if not done this long after it arrived
    prompt: str | tuple[int, ...] | None = None
    cache_salt: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI's function definitions, as given
    # "none": the reply's text is not read for calls; "required" and a named one are enforced
    # by a grammar of the tool call parser's format
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice = "none"
    # the messages the turn adds after the conversation's last reply, before `message`
    tool_results: tuple[ChatMessage, ...] = ()
    # what the reply must match, as the request gave it (its grammar checked)
    response_format: ResponseFormat | None = None
    turn: int | None = None  # the number the turn must get (None: the next, whatever it is)

    @property
    def structure(self) -> dict[str, Any]:
        """What the turn record keeps of what the reply was asked to be (`TurnRecord`):
        `response_format`, `tools` and `tool_choice`, each only where the request gave it."""
        asked = {"response_format": self.response_format, "tools": self.tools}
        kept = {name: value for name, value in asked.items() if value}
        if self.tool_choice != "none":
            kept["tool_choice"] = self.tool_choice
        built: dict[str, Any] = msgspec.to_builtins(kept)
        return built

    @property
    def grammar(self) -> Grammar | None:
        """The grammar `response_format` asks of the reply (None: free text)."""
        return grammar_of(self.response_format, check=False)

    @property
    def forces_call(self) -> bool:
        """Whether the reply must be a tool call."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def tool_name(self) -> str | None:
        """The function the reply must call (None: any or none)."""
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None


class ConversationRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`pensieve.v1.conversations.delete` and `pensieve.v1.chat.cancel`."""

    conversation_id: str


class Page(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`pensieve.v1.conversations.list`, and which part of a listing to answer: after
    `cursor` (a `next_cursor` of the page before), at most `limit` items."""

    cursor: str | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE)] = 100


class GetRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`pensieve.v1.conversations.get`: the conversation's turns from turn number `cursor` (a
    `next_cursor` of a get reply) on, at most `limit`."""

    conversation_id: str
    cursor: str | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE)] = 100

    @property
    def page(self) -> Page:
        return Page(self.cursor, self.limit)


class CreateBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`pensieve.v1.conversations.create`: a conversation with no turn yet, whose first turn
    continues `messages` (none: an empty chat)."""

    messages: tuple[ChatTurn, ...] = ()


class StatsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`pensieve.v1.stats`: no fields."""


class ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    code: ErrorCode
    message: str
    param: str | None = None  # the request's field at fault, where one is


class ErrorReply(msgspec.Struct, frozen=True):
    """Any refusal; also in the NATS service error headers."""

    error: ErrorBody
