"""The chat service's conversations: lookup, creation, deletion, listing and expiry (no I/O
beyond the store's reads; deletes go through the store writer).

A conversation in memory mirrors what the store has committed; one the store has and memory has
not (after a restart) is loaded on its first turn. A conversation lives until it is deleted: by
the client, or by `expire` once it has been idle past its TTL (`ExpiryConfig`). A final turn
ends it: it takes no more turns, and can be read until it expires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
from opentelemetry import trace

from pensieve.actors.config import ExpiryConfig
from pensieve.actors.scheduler.replication import Replicate, after_replicated
from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.replies import ConversationReply, ListReply, PromptSources, TurnSummary
from pensieve.actors.wire.schemas import (
    MAX_PAGE,
    PAGE_BYTES,
    ApiError,
    ChatRequest,
    ChatTurn,
    Page,
    ToolCall,
    ToolChoice,
    ToolDef,
    ToolResult,
)
from pensieve.actors.wire.structured import ResponseFormat
from pensieve.store import (
    ConversationMeta,
    ConversationStore,
    Messages,
    StoreWriter,
    TurnRecord,
    turn_log,
)

FIRST_PAGE = Page(None, MAX_PAGE)


@dataclass
class Conversation:
    conv_id: str
    messages: list[ChatMessage]
    log: list[int]  # the token log as committed (prompt and reply of every finished turn)
    turns: int
    busy: bool = False
    stateless: bool = False  # made by a stateless request (see `ConversationMeta.stateless`)
    ended: bool = False  # a final turn ended it
    tenant: str | None = None  # only requests of this tenant reach it (None: the service's own)
    # its last finished turn's request span, which a trace of its KV leaving later links to
    last_span: trace.SpanContext = trace.INVALID_SPAN_CONTEXT


@dataclass(frozen=True)
class Reservation:
    """A turn that holds its conversation but has no prompt yet (see `ChatService.reserve`)."""

    request: ChatRequest
    conv: Conversation
    messages: list[ChatMessage]  # to render
    new: bool  # a conversation this turn creates


class Conversations:
    """The conversations in memory (`by_id`) over the store's. `restore_kv` tells the engine
    of a conversation loaded from the store (its id and token log); `forget_kv` drops a
    conversation's KV. A request of a tenant reaches only that tenant's conversations: another's
    is not_found, as one that does not exist."""

    def __init__(
        self,
        store: ConversationStore,
        writer: StoreWriter,
        new_id: Callable[[], str],
        restore_kv: Callable[[str, list[int]], None],
        forget_kv: Callable[[str], None],
    ) -> None:
        self.store = store
        self.writer = writer
        self.new_id = new_id
        self.restore_kv = restore_kv
        self.forget_kv = forget_kv
        self.by_id: dict[str, Conversation] = {}
        self._deleting: set[str] = set()  # deleted here, not yet in the store
        self.replicate: Replicate | None = None  # the replicated turn log (None: none)

    def claim(self, request: ChatRequest, tenant: str | None) -> Reservation:
        """The turn's conversation, new or found, marked busy (no other turn may start on it),
        with the messages to render; raises ApiError if it cannot take the turn."""
        new = request.conversation_id is None
        if new:
            stateless = request.messages is not None or request.prompt is not None
            conv = Conversation(self.new_id(), [], [], 0, stateless=stateless, tenant=tenant)
        else:
            conv = self._find(request.conversation_id or "", tenant)
            if request.turn is not None:
                check_turn(conv, request.turn)
            if conv.busy:
                raise ApiError(
                    "invalid_request",
                    f"conversation {conv.conv_id!r} has a turn "
                    "in progress; send the next message after its reply",
                )
            if conv.ended:
                raise ended(conv.conv_id)
        if request.messages is not None:
            messages = list(request.messages)
        elif request.prompt is not None:  # stored as the turn's message: the text, if given
            text = request.prompt if isinstance(request.prompt, str) else ""
            messages = [{"role": "user", "content": text}]
        else:
            messages = [*conv.messages, *request.tool_results]
            if request.message is not None:
                messages.append({"role": "user", "content": request.message})
        conv.busy = True
        self.by_id[conv.conv_id] = conv
        return Reservation(request, conv, messages, new)

    def free(self, reservation: Reservation) -> None:
        """The reserved turn will not run: its conversation is free again (gone, if new)."""
        reservation.conv.busy = False
        if reservation.new:
            self.by_id.pop(reservation.conv.conv_id, None)

    def drop(self, conv_id: str) -> bool:
        """Forget the conversation's copy in memory and its KV (the store's copy changed under
        it: another engine wrote its log); False if a turn of it is in progress."""
        conv = self.by_id.get(conv_id)
        if conv is not None and conv.busy:
            return False
        self.by_id.pop(conv_id, None)
        self.forget_kv(conv_id)
        return True

    def in_memory(self, conv_id: str, tenant: str | None) -> Conversation | None:
        """The tenant's conversation if memory has it; None if only the store has it. Raises
        not_found if neither has it for this tenant."""
        conv = self.by_id.get(conv_id)
        if conv is None or conv.tenant != tenant:
            meta = None if conv is not None else self.store.meta(conv_id)
            if meta is None or meta.tenant != tenant:
                raise not_found(conv_id)
            return None
        return conv

    def get(
        self, conv_id: str, page: Page = FIRST_PAGE, tenant: str | None = None
    ) -> ConversationReply:
        """The conversation's turns from turn `page.cursor` on, as many as fit in one answer
        (`page.limit`, and PAGE_BYTES of text); `next_cursor` continues, None at the end.
        Reads only the store and single values, so any thread may call it (as may `list`)."""
        meta = None if conv_id in self._deleting else self.store.meta(conv_id)
        if meta is None or meta.tenant != tenant:
            raise not_found(conv_id)
        records = self.store.turns(conv_id)
        first = int(page.cursor or 0)
        turns: list[TurnSummary] = []
        size = 0
        for r in records[first : first + page.limit]:
            size += len(r.user_message.encode()) + len(r.assistant_text.encode()) + 200
            if turns and size > PAGE_BYTES:
                break
            history = None if r.history is None else msgspec.convert(r.history, list[ChatTurn])
            sources = prompt_sources(r)
            turns.append(
                TurnSummary(
                    r.turn,
                    r.user_message,
                    r.assistant_text,
                    r.finish_reason,
                    r.prompt_tokens,
                    len(r.output_token_ids),
                    history,
                    sources.cached,
                    sources,
                    r.started_at,
                    msgspec.convert(r.tool_results, tuple[ToolResult, ...]),
                    msgspec.convert(r.tool_calls, tuple[ToolCall, ...]),
                    **_structure(r),
                )
            )
        following = first + len(turns)
        conv = self.by_id.get(conv_id)
        busy = conv is not None and conv.busy
        num_tokens = len(self.store.token_log(conv_id))
        following_cursor = str(following) if following < len(records) else None
        return ConversationReply(
            conv_id,
            turns,
            num_tokens,
            len(records),
            busy,
            meta.ended,
            following_cursor,
            meta.created_at,
            msgspec.convert(meta.opening, list[ChatTurn]),
        )

    def create(
        self, messages: Sequence[ChatMessage], tenant: str | None, now: float
    ) -> tuple[str, Future[Any]]:
        """A new conversation with no turn, whose first turn continues `messages`; its id, and
        the future that resolves once the store has it (it fails: the conversation is gone)."""
        conv = Conversation(self.new_id(), list(messages), [], 0, tenant=tenant)
        self.by_id[conv.conv_id] = conv
        opening = tuple(dict(m) for m in messages)
        created = after_replicated(
            self.replicate,
            conv.conv_id,
            lambda: turn_log.created(opening, now, tenant),
            lambda: self.writer.submit(self.store.create, conv.conv_id, opening, now, tenant),
        )

        def settled(done: Future[Any]) -> None:
            if done.exception() is not None and self.by_id.get(conv.conv_id) is conv:
                self.by_id.pop(conv.conv_id, None)

        created.add_done_callback(settled)
        return conv.conv_id, created

    def delete(self, conv_id: str, tenant: str | None = None) -> Future[Any]:
        """Forget the conversation everywhere; the future resolves once the store forgot it."""
        conv = self.by_id.get(conv_id)
        meta = self.store.meta(conv_id) if conv is None else None
        owner = conv.tenant if conv is not None else meta.tenant if meta is not None else None
        if (conv is None and meta is None) or owner != tenant:
            raise not_found(conv_id)
        if conv is not None and conv.busy:
            raise ApiError("invalid_request", f"conversation {conv_id!r} has a turn in progress")
        self.by_id.pop(conv_id, None)
        self.forget_kv(conv_id)
        # until the writer has deleted it, the store still holds it: no turn may load it again
        self._deleting.add(conv_id)
        deleted = self.writer.submit(self.store.delete, conv_id)
        deleted.add_done_callback(lambda _: self._deleting.discard(conv_id))
        return deleted

    def expired(self, expiry: ExpiryConfig, now: float, limit: int) -> list[str]:
        """Up to `limit` conversations idle past their TTL at `now`, as the store has them.
        Reads only the store, so any thread may call it; `expire` then deletes them."""
        return self.store.select(lambda meta: _is_expired(meta, expiry, now), limit)

    def expire(
        self, conv_ids: Sequence[str], expiry: ExpiryConfig, now: float
    ) -> list[Future[Any]]:
        """Delete those of `conv_ids` still idle past their TTL at `now`, as `delete` does; a
        turn that started or finished since `expired` listed them keeps its conversation.
        Returns the deletes' futures."""
        deleted: list[Future[Any]] = []
        for conv_id in conv_ids:
            conv = self.by_id.get(conv_id)
            if conv_id in self._deleting or (conv is not None and conv.busy):
                continue
            meta = self.store.meta(conv_id)  # not busy: no commit of it is pending
            if meta is not None and _is_expired(meta, expiry, now):
                deleted.append(self.delete(conv_id, meta.tenant))
        return deleted

    def list(self, page: Page = FIRST_PAGE, tenant: str | None = None) -> ListReply:
        """`tenant`'s conversation ids in the store's order, `page.limit` at most after
        `page.cursor`; `next_cursor` continues, None at the end."""
        after = bytes.fromhex(page.cursor) if page.cursor else None
        ids, last = self.store.list_page(after, page.limit, tenant)
        return ListReply(ids, last.hex() if last else None)

    def _find(self, conv_id: str, tenant: str | None) -> Conversation:
        """The tenant's conversation, from memory or else loaded from the store."""
        conv = self.by_id.get(conv_id)
        if conv is not None:
            if conv.tenant != tenant:
                raise not_found(conv_id)
            return conv
        meta = None if conv_id in self._deleting else self.store.meta(conv_id)
        if meta is None or meta.tenant != tenant:
            raise not_found(conv_id)
        if meta.ended:  # its KV is gone and stays gone
            raise ended(conv_id)
        records = self.store.turns(conv_id)
        messages = chat_of(meta.opening, records)
        log = self.store.token_log(conv_id)
        self.restore_kv(conv_id, log)
        return Conversation(
            conv_id, messages, log, len(records), stateless=meta.stateless, tenant=meta.tenant
        )


def chat_of(opening: Messages, records: Sequence[TurnRecord]) -> list[ChatMessage]:
    """A conversation's chat after `records`, its turns, from the messages it was made with."""
    messages = [dict(m) for m in opening]
    for record in records:
        if record.history is not None:
            messages = [dict(m) for m in record.history]
        messages += turn_messages(record)
    return messages


def history_of(conv: Conversation, before: Sequence[ChatMessage]) -> Messages | None:
    """The `TurnRecord.history` of a turn of `conv` whose prompt is `before` and then what it
    sends (its tool results and user message): `before`, unless the turns stored before it
    already say so (None)."""
    stored = conv.messages if conv.turns else []  # a first turn continues no stored turn
    return None if list(before) == stored else tuple(dict(m) for m in before)


def turn_messages(record: TurnRecord) -> list[ChatMessage]:
    """The messages a stored turn added to its conversation: the tool results and the user's
    message it sent, and its reply."""
    sent: list[ChatMessage] = [{"role": "tool", **result} for result in record.tool_results]
    if record.user_message or not sent:
        sent.append({"role": "user", "content": record.user_message})
    return [*sent, reply_message(record.assistant_text, record.tool_calls)]


def reply_message(text: str, tool_calls: Sequence[dict[str, Any]]) -> ChatMessage:
    """A reply as the assistant's message of the chat the next turn renders."""
    message: ChatMessage = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    return message


def _structure(record: TurnRecord) -> dict[str, Any]:
    """What the turn asked its reply to be, as `TurnSummary` says it."""
    return {
        "response_format": msgspec.convert(record.response_format, ResponseFormat | None),
        "tools": msgspec.convert(record.tools, tuple[ToolDef, ...]),
        "tool_choice": msgspec.convert(record.tool_choice, ToolChoice),
    }


def prompt_sources(record: TurnRecord) -> PromptSources:
    """Where the KV of the turn's prompt tokens came from, as its reply and summary say."""
    return PromptSources(
        gpu=record.cached_gpu,
        cpu=record.cached_cpu,
        disk=record.cached_disk,
        recomputed=record.cached_recomputed,
        new=record.new_prompt_tokens,
        shared=record.cached_shared,
    )


def not_found(conv_id: str) -> ApiError:
    """Also the answer for another tenant's conversation: its existence is not revealed."""
    return ApiError("not_found", f"no conversation {conv_id!r}")


def check_turn(conv: Conversation, turn: int) -> None:
    """Raises `conflict` unless the conversation's next turn would be number `turn`: it has
    committed that many turns, and none is in progress (which would take that number). A
    conversation in memory counts the turns its store has committed, which after an adoption
    are the replicated log's (`ownership.py` rebuilds the store and drops the copy in memory)."""
    if turn == conv.turns and not conv.busy:
        return
    has = f"conversation {conv.conv_id!r} has {conv.turns} turn" + ("" if conv.turns == 1 else "s")
    if turn < conv.turns:
        said = f"{has}: turn {turn} is stored (read it with conversations.get)"
    elif turn == conv.turns:
        said = f"{has} and turn {turn} in progress (read it with conversations.get once done)"
    else:
        said = f"{has}: its next turn is turn {conv.turns}, not {turn}"
    raise ApiError("conflict", said, "turn")


def ended(conv_id: str) -> ApiError:
    return ApiError(
        "invalid_request",
        f"conversation {conv_id!r} has ended (a final turn); "
        "it can be read until it expires, and takes no more turns",
    )


def _is_expired(meta: ConversationMeta, expiry: ExpiryConfig, now: float) -> bool:
    return now - meta.last_active > expiry.ttl_s(meta.stateless or meta.ended)
