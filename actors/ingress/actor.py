"""The ingress actor: the client API's front door (`pensieve.v1.*`, see `actors/wire/subjects.py`).

For each request it parses and checks the body against the contract, once (a bad one is
answered here and never reaches the engine), sends a request for a conversation of another
engine on to that engine, and hands the rest, as checked, to its engine's scheduler
(`Bus.hand_off`), which reads it without checking it again: the scheduler acknowledges the
request at once and answers the client itself, streamed deltas included. So an ingress that
goes away loses nothing it already handed over, and several ingress replicas (one queue group)
serve one engine.

A tenant's requests arrive on `pensieve.tenant.<tenant>.v1.*` (NATS maps them there from the
tenant's own account; see `subjects.tenant_subject`): the ingress passes the tenant the subject
names on to the scheduler, which scopes every conversation to it. Nothing in a request body or
header can name a tenant. NATS also names the tenant's connection (`bus.requester`), which
the ingress passes on as well: a turn ends when its requester's connection closes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

import msgspec
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import (
    REQUESTER_HEADER,
    TENANT_HEADER,
    Bus,
    Handler,
    Incoming,
    ServiceInfo,
    requester,
)
from pensieve.actors.wire.jetstream import JetStream
from pensieve.actors.wire.schemas import (
    ApiError,
    encode_body,
    parse_chat,
    parse_conversation,
    parse_create,
    parse_get,
    parse_list,
    parse_stats,
)
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

    def __init__(self, bus: Bus, engine_id: str, jetstream: JetStream | None = None) -> None:
        super().__init__(bus, engine_id)
        self.jetstream = jetstream

    async def setup(self) -> None:
        """Answer the shared subjects (with every engine) and this engine's own."""
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
        lives on another engine goes on to that engine (whose ingress never forwards it
        again), the others to this engine's scheduler as checked."""
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
            await self._hand_to_scheduler(subject, verb, msg, request)

        return route

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
        if not await self.bus.answers(subjects.engine_ping(owner)):
            raise ApiError(
                "unavailable",
                f"engine {owner}, which holds this conversation, is not running; retry when it is",
            )
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
