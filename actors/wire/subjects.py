"""NATS subject names of the client API (version 1), and which engine owns a conversation.

Every engine answers the shared subjects (one queue group) and its own
`pensieve.v1.engine.<id>.*` subjects. A conversation's id names the engine that created it
(`c-<engine id>-<hex>`); a request for it that reaches another engine is forwarded there, so its
KV is used where it lives.
"""

from __future__ import annotations

import re

PREFIX = "pensieve.v1"
SERVICE = "pensieve"  # the name every engine answers service discovery under
CHAT = f"{PREFIX}.chat"
CHAT_CANCEL = f"{PREFIX}.chat.cancel"
CONVERSATIONS_GET = f"{PREFIX}.conversations.get"
CONVERSATIONS_DELETE = f"{PREFIX}.conversations.delete"
CONVERSATIONS_LIST = f"{PREFIX}.conversations.list"
CONVERSATIONS_CREATE = f"{PREFIX}.conversations.create"
STATS = f"{PREFIX}.stats"

_OWNED_ID = re.compile(r"c-([0-9a-f]{8})-[0-9a-f]+")


def engine_subject(engine_id: str, subject: str) -> str:
    """`subject` as addressed to one engine: pensieve.v1.chat -> pensieve.v1.engine.<id>.chat."""
    return f"{PREFIX}.engine.{engine_id}.{subject.removeprefix(PREFIX + '.')}"


def engine_ping(engine_id: str) -> str:
    """The service-discovery ping that only the engine `engine_id` answers."""
    return f"$SRV.PING.{SERVICE}.{engine_id}"


def new_conversation_id(engine_id: str, suffix: str) -> str:
    return f"c-{engine_id}-{suffix}"


def owner(conversation_id: object) -> str | None:
    """The engine id in a conversation id (None for ids that name no engine)."""
    if not isinstance(conversation_id, str):
        return None
    match = _OWNED_ID.fullmatch(conversation_id)
    return match.group(1) if match else None


# ---- tenants: where the service receives a tenant's requests --------------------------------
# A tenant is a NATS account that imports the client API from the service's account mapped to
# `pensieve.tenant.<tenant>.v1.>` (see ops/nats_accounts.py): NATS names the tenant in the
# subject it delivers, and no client can choose it.

TENANT_PREFIX = "pensieve.tenant"
_TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")  # one subject token, no wildcard
_TENANT_SUBJECT = re.compile(re.escape(TENANT_PREFIX) + r"\.([^.]+)\.v1\..+")


def tenant_subject(tenant: str, subject: str) -> str:
    """Client API `subject` as the service receives it from `tenant` ('*': from any tenant):
    pensieve.v1.chat -> pensieve.tenant.<tenant>.v1.chat."""
    if tenant != "*":
        check_tenant_name(tenant)
    if not subject.startswith(PREFIX + "."):
        raise ValueError(f"{subject!r} is not a subject of the client API ({PREFIX}.*)")
    return f"{TENANT_PREFIX}.{tenant}.{subject.removeprefix('pensieve.')}"


def tenant_of(subject: str) -> str | None:
    """The tenant whose request NATS delivered on `subject` (None: not a tenant's subject)."""
    match = _TENANT_SUBJECT.fullmatch(subject)
    return match.group(1) if match else None


def check_tenant_name(name: str) -> None:
    if not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r}: 1-64 of a-z 0-9 _ -, starting with a-z or 0-9")


# ---- the engine's internal subjects: one namespace per engine, one branch per actor ---------

INTERNAL = "pensieve.internal"
ACTORS = (
    "ingress",
    "http-ingress",
    "tokenizer",
    "scheduler",
    "recompute-planner",
    "executor",
    "swap-manager",
)


# the scheduler's `metrics` verb answers the Prometheus text format, version 0.0.4
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def internal(engine_id: str, actor: str, verb: str) -> str:
    """The subject on which `actor` of engine `engine_id` takes `verb` messages:
    pensieve.internal.<engine>.<actor>.<verb>."""
    if actor not in ACTORS:
        raise ValueError(f"unknown actor {actor!r}; one of {', '.join(ACTORS)}")
    return f"{INTERNAL}.{engine_id}.{actor}.{verb}"


def actor_service(actor: str) -> str:
    """The name an actor answers the NATS service protocol under (`$SRV.PING.<name>`)."""
    return f"{SERVICE}-{actor}"


def kv_events(engine_id: str) -> str:
    """Where engine `engine_id` publishes what happened to its conversations' KV chunks."""
    return f"{PREFIX}.engine.{engine_id}.kv"


def engine_load(engine_id: str) -> str:
    """Where engine `engine_id` publishes its load (`messages.LoadReport`)."""
    return f"{PREFIX}.engine.{engine_id}.load"


# every engine's KV events and load reports, for an ingress that places turns
ALL_KV_EVENTS = kv_events("*")
ALL_LOADS = engine_load("*")
