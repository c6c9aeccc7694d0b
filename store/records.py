"""What the store keeps about a conversation: one record per finished turn, and its metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_CONVERSATION_ID_CHARS = 200
Messages = tuple[dict[str, Any], ...]  # a chat: {"role", "content", ...} each


def validate_conversation_id(conv_id: object) -> str:
    """Return `conv_id` if it is a usable conversation id; raise ValueError otherwise.

    A conversation id is any non-empty string of at most 200 characters that encodes to UTF-8
    (so no lone surrogates). Ids come from clients, so the message says what is wrong.
    """
    if not isinstance(conv_id, str):
        raise ValueError(f"conversation id must be a string, not {type(conv_id).__name__}")
    if not conv_id:
        raise ValueError("conversation id must not be empty")
    if len(conv_id) > MAX_CONVERSATION_ID_CHARS:
        raise ValueError(
            f"conversation id has {len(conv_id)} characters; at most "
            f"{MAX_CONVERSATION_ID_CHARS} are allowed"
        )
    try:
        conv_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"conversation id is not valid UTF-8: {exc.reason}") from None
    return conv_id


def _require_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class TurnRecord:
    """One finished turn of a conversation, as the client saw it.

    `turn` counts from 0 and equals the number of turns committed before it. `prompt_tokens` is
    the length of the whole rendered prompt of this turn (history included); `new_prompt_tokens`
    is how many of those had never been in the conversation's token log before. The cached counts
    say where the rest of the prompt's KV came from.

    `history`: the chat before `user_message` in this turn's prompt, when it is not the
    conversation's chat so far (its turns' messages and replies, or the messages it was created
    with): a first turn with a system message, a turn whose client sent a chat that edits or
    replaces the conversation's. None: the turn continued the conversation's chat, so the turns
    before it say what its prompt held (and a stateless client that resends its chat stores it
    once).
    """

    turn: int
    user_message: str
    assistant_text: str
    prompt_tokens: int
    new_prompt_tokens: int
    output_token_ids: tuple[int, ...]
    finish_reason: str
    cached_gpu: int
    cached_cpu: int
    cached_recomputed: int
    started_at: float
    finished_at: float
    history: Messages | None = None
    # what answered the last turn's tool calls ({"tool_call_id", "content"}), sent before
    # `user_message` ("" if none came), and the calls read from this turn's reply (OpenAI's
    # {"id", "type", "function": {"name", "arguments"}}); () when none
    tool_results: tuple[dict[str, Any], ...] = ()
    tool_calls: tuple[dict[str, Any], ...] = ()
    # what the turn asked of its reply's shape, as its request gave it: the response format
    # (None: free text), the tools shown to the model and the tool choice
    response_format: dict[str, Any] | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] = "none"
    # read back from the disk tier, and of `cached_gpu` and `cached_cpu` those found by content
    # in another conversation's chunks (0 in a record written before they were kept)
    cached_disk: int = 0
    cached_shared: int = 0

    def __post_init__(self) -> None:
        for name in ("tool_results", "tool_calls", "tools"):  # as JSON reads them back: lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.output_token_ids, tuple):
            raise TypeError("output_token_ids must be a tuple of ints")
        _require_non_negative(
            turn=self.turn,
            prompt_tokens=self.prompt_tokens,
            new_prompt_tokens=self.new_prompt_tokens,
            cached_gpu=self.cached_gpu,
            cached_cpu=self.cached_cpu,
            cached_recomputed=self.cached_recomputed,
            cached_disk=self.cached_disk,
            cached_shared=self.cached_shared,
        )
        if self.new_prompt_tokens > self.prompt_tokens:
            raise ValueError("new_prompt_tokens cannot exceed prompt_tokens")
        if self.finished_at < self.started_at:
            raise ValueError("finished_at is before started_at")


@dataclass(frozen=True)
class ConversationMeta:
    """Bookkeeping of one conversation; `last_active` is the end of its latest turn (unix time).

    `stateless`: made by a request that sent the whole chat and no id, so its client keeps the
    history and it expires sooner. `ended`: its last turn was final; it takes no more turns.
    Both default to False, which is what a meta written before they existed means. `tenant`:
    the tenant whose request made it (None: the service's own account, or a server without
    tenants); only that tenant reaches it. `opening`: the messages it was created with
    (`ConversationStore.create`), kept until its first turn, whose `history` then holds them."""

    conversation_id: str
    created_at: float
    last_active: float
    num_turns: int
    log_len: int
    stateless: bool = False
    ended: bool = False
    tenant: str | None = None
    opening: Messages = ()
