"""The ingress actor: the client API's front door (`pensieve.v1.*`, see `actors/wire/subjects.py`).

For each request it checks the body against the contract (a bad one is answered here and never
reaches the engine), sends a request for a conversation of another engine on to that engine, and
hands the rest to its engine's scheduler (`Bus.hand_off`): the scheduler acknowledges the
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
from typing import Any, ClassVar

import orjson
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import (
    REQUESTER_HEADER,
    TENANT_HEADER,
    Handler,
    Incoming,
    ServiceInfo,
    requester,
)
from pensieve.actors.wire.schemas import (
    CONVERSATION_FIELDS,
    NO_FIELDS,
    ApiError,
    conversation_id,
    load_fields,
    parse_chat,
    parse_get,
    parse_list,
)
from pensieve.actors.wire.version import version

logger = logging.getLogger(__name__)

HANDOFF_TIMEOUT_S = 5.0  # a scheduler takes a request within milliseconds; silence means gone


def _check_delete(data: bytes) -> object:  # and cancel: a conversation id alone
    return conversation_id(load_fields(data, CONVERSATION_FIELDS))


def _check_stats(data: bytes) -> object:
    return load_fields(data, NO_FIELDS)


# each client subject: the check of its body, and the scheduler verb that answers it
ROUTES: dict[str, tuple[Callable[[bytes], object], str]] = {
    subjects.CHAT: (parse_chat, "chat"),
    subjects.CHAT_CANCEL: (_check_delete, "cancel"),
    subjects.CONVERSATIONS_GET: (parse_get, "get"),
    subjects.CONVERSATIONS_DELETE: (_check_delete, "delete"),
    subjects.CONVERSATIONS_LIST: (parse_list, "list"),
    subjects.STATS: (_check_stats, "stats"),
}
OWNED = (
    subjects.CHAT,
    subjects.CHAT_CANCEL,
    subjects.CONVERSATIONS_GET,
    subjects.CONVERSATIONS_DELETE,
)


class IngressActor(Actor):
    name: ClassVar[str] = "ingress"
    description: ClassVar[str] = "the client API: checks requests, hands them to the scheduler"

    async def setup(self) -> None:
        """Answer the shared subjects (with every engine) and this engine's own."""
        for subject in ROUTES:
            handler = self._route(subject)
            if subject in OWNED:
                handler = self._owned(subject, handler)
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

    def _owned(self, subject: str, handler: Handler) -> Handler:
        """`handler` for requests whose conversation lives here; the others go on to the engine
        that owns them (whose ingress never forwards them again)."""

        async def route(msg: Incoming) -> None:
            owner = subjects.owner(_conversation_id(msg.data))
            if owner is None or owner == self.engine_id:
                await handler(msg)
                return
            # a forwarded request nobody takes would leave its requester waiting out its
            # timeout (NATS tells the forwarder, not the requester, that nobody answered)
            if not await self.bus.answers(subjects.engine_ping(owner)):
                raise ApiError(
                    "unavailable",
                    f"engine {owner}, which holds this "
                    "conversation, is not running; retry when it is",
                )
            there = subjects.engine_subject(owner, subject)
            tenant = subjects.tenant_of(msg.subject)
            await msg.forward(there if tenant is None else subjects.tenant_subject(tenant, there))

        return route

    def _route(self, subject: str) -> Handler:
        check, verb = ROUTES[subject]
        scheduler = self.subject(verb, "scheduler")
        tracer = tracing.tracer("ingress")

        async def hand_to_scheduler(msg: Incoming) -> None:
            parent = propagate.extract(msg.headers)
            with tracer.start_as_current_span(
                subject, context=parent, kind=SpanKind.SERVER, record_exception=False
            ) as span:
                try:
                    check(msg.data)  # a bad body goes no further
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
                    await self.bus.hand_off(scheduler, msg, headers, HANDOFF_TIMEOUT_S)
                except (ConnectionError, TimeoutError) as lost:
                    logger.warning("%s", lost)
                    error = ApiError(
                        "unavailable",
                        f"the scheduler of engine {self.engine_id} "
                        "is not running; retry when it is",
                    )
                    tracing.record_refusal(span, error)
                    raise error from None
                except ApiError as error:
                    tracing.record_refusal(span, error)
                    raise

        return hand_to_scheduler


def _conversation_id(data: bytes) -> object:
    try:
        body: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None  # the handler reports it
    return body.get("conversation_id") if isinstance(body, dict) else None
