"""The client API's messages (`pensieve.v1.*`): request and reply bodies as msgspec Structs, and
the parsing of requests.

A request body is parsed once, by the ingress (`parse_chat`, `parse_get`, ...): its types and
ranges are checked while it is decoded, then the rules that span fields. Bad input raises
`ApiError` with one of the contract's codes and a message that says what is wrong. The ingress
hands the checked request on as `encode_body` writes it, and the scheduler reads it back with
`read_checked`, checking nothing again. The same types give the published JSON Schema
(`actors/wire/json_schema.py`); nothing here touches the engine.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.structured import Grammar, GrammarError, ResponseFormat, grammar_of
from pensieve.store import validate_conversation_id

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

_S = TypeVar("_S", bound=msgspec.Struct)
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


# what a field must be, said in a refusal of a value the decoder did not take
_RULES = {
    "conversation_id": "'conversation_id' must be a string",
    "message": "'message' must be a non-empty string",
    "messages": "'messages' must be a non-empty array",
    "max_tokens": f"'max_tokens' must be an integer in [1, {MAX_TOKENS_LIMIT}]",
    "temperature": "'temperature' must be a number >= 0",
    "top_p": "'top_p' must be a number in (0, 1]",
    "top_k": "'top_k' must be null or an integer >= 1",
    "min_p": "'min_p' must be a number in [0, 1)",
    "min_tokens": f"'min_tokens' must be an integer in [0, {MAX_TOKENS_LIMIT}]",
    "presence_penalty": "'presence_penalty' must be a number in [-2, 2]",
    "frequency_penalty": "'frequency_penalty' must be a number in [-2, 2]",
    "logit_bias": f"'logit_bias' must be null or an object of up to {MAX_LOGIT_BIAS} token ids "
    "(strings of digits) to numbers in [-100, 100]",
    "seed": f"'seed' must be null or an integer in [0, {MAX_SEED}]",
    "stop": f"'stop' must be up to {MAX_STOP_STRINGS} non-empty strings",
    "ignore_eos": "'ignore_eos' must be true or false",
    "stream": "'stream' must be true or false",
    "final": "'final' must be true or false",
    "timeout_s": f"'timeout_s' must be null or a number in (0, {MAX_TIMEOUT_S:.0f}]",
    "prompt": "'prompt' must be a non-empty string or a non-empty array of token ids",
    "cache_salt": f"'cache_salt' must be null or a string of 1 to {MAX_CACHE_SALT} characters",
    "tools": "'tools' must be an array of {'type': 'function', 'function': {'name', "
    "'description', 'parameters'}} (a name of 1 to 64 letters, digits, '_', '.', '-')",
    "tool_choice": "'tool_choice' must be 'auto', 'none', 'required' or "
    "{'type': 'function', 'function': {'name'}}",
    "tool_results": "'tool_results' must be a non-empty array of {'tool_call_id', 'content'}",
    "response_format": "'response_format' must be {'type': 'text' | 'json_object' | "
    "'json_schema' | 'regex' | 'grammar'}, with 'json_schema': {'name', 'schema', 'strict'}, "
    "'regex' or 'grammar' (Lark) for the last three",
    "cursor": "'cursor' must be a 'next_cursor' from a reply",
    "limit": f"'limit' must be an integer in [1, {MAX_PAGE}]",
    "turn": "'turn' must be null or an integer >= 0",
}
_AT = re.compile(r" - at `\$\.(\w+)(?:\[(\d+)\](?:\.(\w+))?)?")
_FIELD = re.compile(r"(unknown|missing required) field `([^`]*)`")
_KINDS = {"array": "an array", "str": "a string", "bool": "a boolean", "null": "null"}


def _decode(data: bytes, cls: type[_S]) -> _S:
    """The request body as `cls` (an empty body is an empty object)."""
    try:
        return msgspec.json.decode(data if data.strip() else b"{}", type=cls)
    except msgspec.ValidationError as error:
        raise ApiError("invalid_request", _explain(str(error))) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ApiError("invalid_request", f"body is not valid JSON: {error}") from None


def _explain(problem: str) -> str:
    """A refusal in the API's words, from the decoder's."""
    at = _AT.search(problem)
    if at is not None and at[2] is not None and at[1] == "messages":
        if at[3] == "role":
            return f"messages[{at[2]}].role must be one of {ROLES}"
        if at[3] == "content":
            return f"messages[{at[2]}].content must be a string"
        if at[3] in ("tool_calls", "tool_call_id"):
            return f"messages[{at[2]}].{at[3]} must be " + (
                "a string" if at[3] == "tool_call_id" else "an array of tool calls"
            )
        return f"messages[{at[2]}] must be {{'role', 'content'}}"
    if at is not None:
        return _RULES.get(at[1], f"'{at[1]}': {problem}")
    field = _FIELD.search(problem)
    if field is not None and field[1] == "unknown":
        return f"unknown field(s): {field[2]}"
    if field is not None:
        return f"'{field[2]}' is required"
    kind = re.search(r"Expected `object`, got `(\w+)`", problem)
    if kind is not None:
        return f"body must be a JSON object, not {_KINDS.get(kind[1], 'a number')}"
    return problem


def parse_chat(data: bytes) -> ChatRequest:
    body = _decode(data, ChatBody)
    conv_id = None if body.conversation_id is None else _conversation_id(body.conversation_id)
    message = None if isinstance(body.message, UnsetType) else body.message
    messages = None if isinstance(body.messages, UnsetType) else body.messages
    prompt = None if isinstance(body.prompt, UnsetType) else body.prompt
    results = None if isinstance(body.tool_results, UnsetType) else body.tool_results
    stateful = message is not None or results is not None
    if sum((stateful, messages is not None, prompt is not None)) != 1:
        raise ApiError(
            "invalid_request",
            "give exactly one of 'message' (and/or 'tool_results'), 'messages' or 'prompt'",
        )
    if results is not None and conv_id is None:
        raise ApiError(
            "invalid_request", "'tool_results' answer a conversation's reply: give its id"
        )
    if message == "":
        raise ApiError("invalid_request", _RULES["message"])
    if prompt is not None and not prompt:
        raise ApiError("invalid_request", _RULES["prompt"])
    if body.turn and conv_id is None:
        raise ApiError("invalid_request", "a new conversation's first turn is turn 0", "turn")
    if prompt is not None and conv_id is not None:
        raise ApiError(
            "invalid_request", "a 'prompt' continues no conversation: leave out 'conversation_id'"
        )
    stop = (body.stop,) if isinstance(body.stop, str) else body.stop
    try:
        grammar = grammar_of(body.response_format)
    except GrammarError as error:
        raise ApiError("invalid_request", str(error), error.field) from None
    _check_min_tokens(body, bool(stop), grammar is not None)
    return ChatRequest(
        conversation_id=conv_id,
        message=message,
        messages=None if messages is None else _messages(messages),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items())),
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        stream=body.stream,
        final=body.final or prompt is not None,  # a raw completion is one turn
        timeout_s=body.timeout_s,
        prompt=prompt,
        cache_salt=body.cache_salt,
        **_tool_use(body, prompt is not None),
        tool_results=tuple(
            {"role": "tool", "content": r.content, "tool_call_id": r.tool_call_id}
            for r in results or ()
        ),
        response_format=body.response_format,
        turn=body.turn,
    )


def _check_min_tokens(body: ChatBody, stops: bool, constrained: bool) -> None:
    if not body.min_tokens:
        return
    if body.min_tokens > body.max_tokens:
        raise ApiError("invalid_request", "'min_tokens' must be at most 'max_tokens'", "min_tokens")
    named = isinstance(body.tool_choice, NamedToolChoice)
    if stops or constrained or body.tool_choice == "required" or named:
        raise ApiError(
            "invalid_request",
            "'min_tokens' goes with neither stop strings nor a constrained reply "
            "('response_format', a required or named tool choice)",
            "min_tokens",
        )


def _tool_use(body: ChatBody, raw: bool) -> dict[str, Any]:
    """The request's tools and what it asks of them (`ChatRequest.tools` and on)."""
    tools = tuple(msgspec.to_builtins(tool) for tool in body.tools)
    if tools and raw:
        raise ApiError("invalid_request", "a 'prompt' has no chat template to show 'tools' in")
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice == "required" and not tools:
        raise ApiError("invalid_request", "tool_choice 'required' needs 'tools'")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            "invalid_request",
            "a reply cannot be both a forced tool call and a 'response_format': give one",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {tool.function.name for tool in body.tools}:
            raise ApiError(
                "invalid_request", f"tool_choice names {name!r}, which is none of 'tools'"
            )
    elif choice == "auto" and not tools:
        raise ApiError("invalid_request", "tool_choice 'auto' needs 'tools'")
    return {"tools": tools, "tool_choice": choice}


def _messages(turns: tuple[ChatTurn, ...]) -> tuple[ChatMessage, ...]:
    if not turns:
        raise ApiError("invalid_request", _RULES["messages"])
    if turns[-1].role not in ("user", "tool"):
        raise ApiError("invalid_request", "the last of 'messages' must be the user's or a tool's")
    return tuple(_message(i, turn) for i, turn in enumerate(turns))


def _message(i: int, turn: ChatTurn) -> ChatMessage:
    if turn.content is None and not turn.tool_calls:
        raise ApiError("invalid_request", f"messages[{i}].content must be a string")
    if turn.tool_calls and turn.role != "assistant":
        raise ApiError("invalid_request", f"messages[{i}]: only an assistant's has 'tool_calls'")
    if (turn.role == "tool") != (turn.tool_call_id is not None):
        raise ApiError(
            "invalid_request", f"messages[{i}]: a tool's message, and only one, has 'tool_call_id'"
        )
    message: ChatMessage = {"role": turn.role, "content": turn.content or ""}
    if turn.tool_calls:
        message["tool_calls"] = [msgspec.to_builtins(call) for call in turn.tool_calls]
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    return message


def parse_conversation(data: bytes) -> ConversationRef:
    """`conversations.delete` and `chat.cancel`: a conversation id alone."""
    ref = _decode(data, ConversationRef)
    _conversation_id(ref.conversation_id)
    return ref


def parse_list(data: bytes) -> Page:
    """`conversations.list`: `{"cursor": <next_cursor of the page before>, "limit": N}`."""
    page = _decode(data, Page)
    if page.cursor is not None and not _is_hex(page.cursor):
        raise ApiError("invalid_request", "'cursor' must be a 'next_cursor' from a list reply")
    return page


def parse_get(data: bytes) -> GetRequest:
    """`conversations.get`: `{"conversation_id", "cursor": <next_cursor>, "limit": N}`; the
    cursor is the number of the first turn to answer."""
    request = _decode(data, GetRequest)
    _conversation_id(request.conversation_id)
    if request.cursor is not None and not _is_turn_number(request.cursor):
        raise ApiError("invalid_request", "'cursor' must be a 'next_cursor' from a get reply")
    return request


def parse_create(data: bytes) -> CreateBody:
    """`conversations.create`: `{"messages": [...]}`, the chat its first turn continues."""
    return _decode(data, CreateBody)


def parse_stats(data: bytes) -> StatsRequest:
    return _decode(data, StatsRequest)


def encode_body(body: msgspec.Struct) -> bytes:
    """A body of the client API as JSON: a checked request as the ingress hands it to the
    scheduler, or a reply."""
    return _ENCODER.encode(body)


def read_checked(data: bytes, cls: type[_S]) -> _S:
    """A request the ingress checked and encoded (`encode_body`): decoded, not checked again."""
    try:
        return msgspec.json.decode(data, type=cls)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ApiError("invalid_request", f"not a request the ingress checked: {error}") from None


def _conversation_id(value: str) -> str:
    try:
        return validate_conversation_id(value)
    except ValueError as exc:
        raise ApiError("invalid_request", str(exc)) from None


def _is_turn_number(text: str) -> bool:
    # ASCII only: str.isdigit also takes '²', which int() refuses; 20 digits stay far below
    # int()'s limit on the digits it reads (4300) and above any turn count
    return text.isascii() and text.isdigit() and len(text) <= 20


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return bool(text)


class ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    code: ErrorCode
    message: str
    param: str | None = None  # the request's field at fault, where one is


class ErrorReply(msgspec.Struct, frozen=True):
    """Any refusal; also in the NATS service error headers."""

    error: ErrorBody
