"""The ingress actor: the client API's front door (`pensieve.v1.*`, see `actors/wire/subjects.py`).

For each request it parses and checks the body against the contract, once (a bad one is
answered here and never reaches the engine), sends a request for a conversation of another
engine on to that engine, and hands the rest, as checked, to its engine's scheduler
(`Bus.hand_off`), which reads it without checking it again: the scheduler acknowledges the
request at once and answers the client itself, streamed deltas included. So an ingress that
goes away loses nothing it already handed over, and several ingress replicas (one queue group)
serve one engine. A request that names no conversation and came on a shared subject is placed
among the engines first (`placement.py`: by load, and a resent history by its cached prefix) and
forwarded to the chosen one's own subject.

A tenant's requests arrive on `pensieve.tenant.<tenant>.v1.*` (NATS maps them there from the
tenant's own account; see `subjects.tenant_subject`): the ingress passes the tenant the subject
names on to the scheduler, which scopes every conversation to it. Nothing in a request body or
header can name a tenant. NATS also names the tenant's connection (`incoming.requester`), which
the ingress passes on as well: a turn ends when its requester's connection closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import ClassVar

import msgspec
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.ingress.placement import Placement, PlacementConfig, Policy, PromptKeys
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Bus, ServiceInfo
from pensieve.actors.wire.calls import render_remote
from pensieve.actors.wire.chunk_keys import ChunkKey
from pensieve.actors.wire.incoming import (
    REQUESTER_HEADER,
    TENANT_HEADER,
    Handler,
    Incoming,
    requester,
)
from pensieve.actors.wire.jetstream import JetStream
from pensieve.actors.wire.messages import LoadReport, decode, decode_kv_events
from pensieve.actors.wire.request_parsing import (
    encode_body,
    parse_chat,
    parse_conversation,
    parse_create,
    parse_get,
    parse_list,
    parse_stats,
)
from pensieve.actors.wire.schemas import ApiError, ChatRequest
from pensieve.actors.wire.version import version

logger = logging.getLogger(__name__)

HANDOFF_TIMEOUT_S = 5.0  # a scheduler takes a request within milliseconds; silence means gone


# each client subject: the parser of its body, and the scheduler verb that answers it
ROUTES: dict[str, tuple[Callable[[bytes], msgspec.Struct], str]] = {
    subjects.CHAT: (parse_chat, "chat"),
    subjects.CHAT_CANCEL: (parse_conversation, "cancel"),
    subjects.CONVERSATIONS_GET: (parse_get, "get"),
    subjects.CONVERSATIONS_DELETE: (parse_conversation, "delete"),
    subjects.CONVERSATIONS_LIST: (parse_list, "list"),
    subjects.CONVERSATIONS_CREATE: (parse_create, "create"),
    subjects.STATS: (parse_stats, "stats"),
}
# requests that start a conversation: placed among the engines (`placement.py`)
PLACED = (subjects.CHAT, subjects.CONVERSATIONS_CREATE)
RENDER_S = 5.0  # what placement gives the prompt's render; past it, a turn is placed by load
OWNED = (
    subjects.CHAT,
    subjects.CHAT_CANCEL,
    subjects.CONVERSATIONS_GET,
    subjects.CONVERSATIONS_DELETE,
)


class IngressActor(Actor):
    """With `jetstream` (many engines sharing a replicated turn log), a conversation goes to
    the engine that holds it in the owner bucket while that engine's lease lives, and to this
    engine's scheduler, which adopts it, once the lease has lapsed (or the owner let it go)."""

    name: ClassVar[str] = "ingress"
    description: ClassVar[str] = "the client API: checks requests, hands them to the scheduler"

    def __init__(
        self,
        bus: Bus,
        engine_id: str,
        jetstream: JetStream | None = None,
        placement: PlacementConfig | None = None,
        prompt_keys: PromptKeys | None = None,
    ) -> None:
        """`placement`: how a turn that names no conversation is placed among the engines
        (`placement.py`; None: it stays with this engine); `prompt_keys`: how the engines key
        a prompt's chunks, for the prefix policy."""
        super().__init__(bus, engine_id)
        self.jetstream = jetstream
        self.placement = None if placement is None else Placement(engine_id, placement)
        self.prompt_keys = prompt_keys

    async def setup(self) -> None:
        """Answer the shared subjects (with every engine) and this engine's own; follow every
        engine's load reports (and KV events, to place by prefix)."""
        if self.placement is not None:
            await self.bus.mailbox(subjects.ALL_LOADS, self._on_load)
            if self.placement.config.policy is Policy.PREFIX and self.prompt_keys is not None:
                await self.bus.mailbox(subjects.ALL_KV_EVENTS, self._on_kv_events)
        for subject in ROUTES:
            handler = self._route(subject)
            own = subjects.engine_subject(self.engine_id, subject)
            # a tenant's requests arrive on its own subjects (see `subjects.tenant_subject`)
            for delivered in (
                subject,
                own,
                subjects.tenant_subject("*", subject),
                subjects.tenant_subject("*", own),
            ):
                await self.bus.serve(delivered, handler)
        # the client API's service: one per engine, whichever of its ingress replicas answers
        await self.bus.advertise(
            ServiceInfo(
                subjects.SERVICE,
                self.engine_id,
                version(),
                "stateful LLM serving: chat turns whose KV cache is kept across turns",
            )
        )

    def _route(self, subject: str) -> Handler:
        """The handler of `subject`: its body parsed once, here; a request whose conversation
        lives on another engine, or placed on another engine, goes on to that engine (whose
        ingress never forwards it again), the others to this engine's scheduler as checked."""
        parse, verb = ROUTES[subject]

        async def route(msg: Incoming) -> None:
            try:
                request: msgspec.Struct | ApiError = parse(msg.data)
            except ApiError as refused:  # refused in the request's span
                request = refused
            conv_id: str = getattr(request, "conversation_id", None) or ""
            owner = subjects.owner(conv_id)
            if subject in OWNED and owner is not None and self.jetstream is not None:
                owner = await self._holder(conv_id, owner)
            if subject in OWNED and owner is not None and owner != self.engine_id:
                await self._forward(subject, msg, owner)
                return
            if self._places(subject, msg, request):
                placed = await self._place(msg, request)
                if placed != self.engine_id and await self._answers(placed):
                    await self._send_to(subject, msg, placed)
                    return
            await self._hand_to_scheduler(subject, verb, msg, request)

        return route

    def _places(self, subject: str, msg: Incoming, request: msgspec.Struct | ApiError) -> bool:
        """Whether the request starts a conversation and came on a shared subject (one sent to
        this engine's own subjects, a placed one among them, stays here)."""
        if self.placement is None or subject not in PLACED:
            return False
        if isinstance(request, ApiError) or getattr(request, "conversation_id", None):
            return False
        tenant = subjects.tenant_of(msg.subject)
        return msg.subject == (
            subject if tenant is None else subjects.tenant_subject(tenant, subject)
        )

    async def _place(self, msg: Incoming, request: msgspec.Struct) -> str:
        """The engine to start the request's conversation (`Placement.place`)."""
        assert self.placement is not None
        keys: list[ChunkKey] = []
        num_tokens = 0
        if isinstance(request, ChatRequest) and self.placement.wants_prompt(time.monotonic()):
            ids = await self._prompt_ids(request)
            if ids is not None and self.prompt_keys is not None:
                tenant = subjects.tenant_of(msg.subject)
                keys = self.prompt_keys.of(ids, tenant, request.cache_salt)
                num_tokens = len(ids)
        choice = self.placement.place(time.monotonic(), keys, num_tokens)
        logger.debug(
            "placed on engine %s by %s (%d of %d blocks cached there, cost %.1f)",
            choice.engine_id,
            choice.reason.value,
            choice.num_cached_blocks,
            len(keys),
            choice.cost,
        )
        return choice.engine_id

    async def _prompt_ids(self, request: ChatRequest) -> list[int] | None:
        """A stateless request's prompt ids, rendered by this engine's tokenizer as its
        scheduler renders them (None: not stateless, or not rendered: then placed by load; the
        scheduler refuses a bad one itself)."""
        prompt = request.prompt
        if isinstance(prompt, tuple):
            return list(prompt)
        if prompt is None and request.messages is None:
            return None
        try:
            if prompt is not None:
                return await render_remote(self.bus, self.engine_id, [], RENDER_S, None, prompt)
            messages = list(request.messages or ())
            return await render_remote(
                self.bus, self.engine_id, messages, RENDER_S, tools=request.tools
            )
        except ApiError as refused:
            logger.debug("placed by load: the prompt was not rendered (%s)", refused)
            return None

    async def _on_load(self, data: bytes, headers: dict[str, str]) -> None:
        assert self.placement is not None
        self.placement.report(decode(data, LoadReport), time.monotonic())

    async def _on_kv_events(self, data: bytes, headers: dict[str, str]) -> None:
        assert self.placement is not None
        self.placement.kv_events(decode_kv_events(data))

    async def _holder(self, conv_id: str, named: str | None) -> str | None:
        """The engine to serve the conversation: its owner while the owner's lease lives,
        else (None) this one, which adopts it. A conversation nobody holds in the bucket (let
        go by a drained engine, or made before the log) goes where its id says while that
        engine answers."""
        assert self.jetstream is not None
        try:
            held = await self.jetstream.owner(conv_id)
            if held is None:
                alive = named is not None and await self.bus.answers(subjects.engine_ping(named))
                return named if alive or named == self.engine_id else None
            if held.engine == self.engine_id or await self.jetstream.alive(held.engine):
                return held.engine
            return None
        except Exception as error:  # JetStream away (a node down, a leader elected): by the id
            logger.warning("the owner of %s is not known (%s); routing by its id", conv_id, error)
            return named

    async def _forward(self, subject: str, msg: Incoming, owner: str) -> None:
        # a forwarded request nobody takes would leave its requester waiting out its
        # timeout (NATS tells the forwarder, not the requester, that nobody answered)
        if not await self._answers(owner):
            raise ApiError(
                "unavailable",
                f"engine {owner}, which holds this conversation, is not running; retry when it is",
            )
        await self._send_to(subject, msg, owner)

    async def _answers(self, engine_id: str) -> bool:
        return await self.bus.answers(subjects.engine_ping(engine_id))

    async def _send_to(self, subject: str, msg: Incoming, owner: str) -> None:
        """Forward the request to engine `owner`'s own subject, as its tenant sent it."""
        there = subjects.engine_subject(owner, subject)
        tenant = subjects.tenant_of(msg.subject)
        await msg.forward(there if tenant is None else subjects.tenant_subject(tenant, there))

    async def _hand_to_scheduler(
        self, subject: str, verb: str, msg: Incoming, request: msgspec.Struct | ApiError
    ) -> None:
        parent = propagate.extract(msg.headers)
        tracer = tracing.tracer("ingress")
        with tracer.start_as_current_span(
            subject, context=parent, kind=SpanKind.SERVER, record_exception=False
        ) as span:
            try:
                if isinstance(request, ApiError):  # a bad body goes no further
                    raise request
                headers: dict[str, str] = {}
                propagate.inject(headers)  # the scheduler's spans go under this one
                tenant = subjects.tenant_of(msg.subject)  # named by NATS, not the client
                if tenant is not None:
                    span.set_attribute("pensieve.tenant", tenant)
                    headers[TENANT_HEADER] = tenant
                    # its connection, whose closing cancels its turn (nats-server's word)
                    sender = requester(msg.headers)
                    if sender is not None:
                        headers[REQUESTER_HEADER] = sender
                scheduler = self.subject(verb, "scheduler")
                body = encode_body(request)
                await self.bus.hand_off(scheduler, msg, headers, HANDOFF_TIMEOUT_S, body)
            except (ConnectionError, TimeoutError) as lost:
                logger.warning("%s", lost)
                error = ApiError(
                    "unavailable",
                    f"the scheduler of engine {self.engine_id} is not running; retry when it is",
                )
                tracing.record_refusal(span, error)
                raise error from None
            except ApiError as error:
                tracing.record_refusal(span, error)
                raise
