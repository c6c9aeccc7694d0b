"""A request as a bus handler gets it (`Incoming`): its body, reply subject and headers, and
how it is answered or handed on; the headers Pensieve and nats-server set on requests and error
replies. The bus (`bus.py`, the only module that imports `nats`) delivers it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import orjson

from pensieve.actors.wire.schemas import ERROR_STATUS, ApiError

if TYPE_CHECKING:
    from pensieve.actors.wire.bus import Bus


class _Server(Protocol):
    """What `check_fits` reads of a NATS connection."""

    @property
    def max_payload(self) -> int: ...


ERROR_HEADER = "Pensieve-Error"  # set to the error code on every error reply
SERVICE_ERROR_HEADER = "Nats-Service-Error"  # the NATS service protocol's error headers
SERVICE_ERROR_CODE_HEADER = "Nats-Service-Error-Code"
# a handed-off request carries the requester's inbox here (see `Bus.hand_off`), and the tenant
# it came from, as NATS delivered it (absent: the service's own account)
REPLY_TO_HEADER = "Pensieve-Reply-To"
TENANT_HEADER = "Pensieve-Tenant"
# a tenant's request forwarded to another engine: its reply subject, which nats-server made for
# the tenant's import ("_R_.*") and lets no client name as a reply subject of its own
FORWARDED_REPLY_HEADER = "Pensieve-Forwarded-Reply"
IMPORT_REPLY_PREFIX = "_R_."
# the connection a tenant's request came from, as nats-server named it (see `requester`)
REQUESTER_HEADER = "Pensieve-Requester"
# set by nats-server on a request that crossed into the service account through an import
# with `share`, in place of anything the client sent under that name
REQUEST_INFO_HEADER = "Nats-Request-Info"


def check_fits(client: _Server, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
    """ApiError("too_long") unless the message fits the server's `max_payload`, its headers
    counted as nats-server counts them (an empty dict of headers still sends their first and
    last line). A message that does not fit must never be sent: nats-server answers it by
    closing the connection, and what was in flight on it is lost."""
    size = len(data)
    if headers is not None:  # "NATS/1.0\r\n", a "key: value\r\n" line each, "\r\n" (even none)
        size += 12 + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())
    limit = client.max_payload
    if size > limit:
        raise ApiError(
            "too_long",
            f"a message of {size} bytes on {subject} would pass the NATS server's limit of "
            f"{limit} bytes; send a shorter request",
        )


@dataclass
class Incoming:
    data: bytes
    reply: str
    headers: dict[str, str]  # W3C trace context rides here ("traceparent")
    _bus: Bus  # answers go out on its connection of the moment (a new one after a close)
    subject: str = ""  # where it was delivered (a tenant's requests name the tenant)

    async def send(
        self, body: bytes, headers: dict[str, str] | None = None, probe: str = ""
    ) -> None:
        """Publish one message to the requester's inbox (nothing if it gave none); with
        `probe`, a subject of `Bus.on_no_responders`, as its reply subject, which a client
        reading the message ignores."""
        if self.reply:
            client = self._bus.client
            check_fits(client, self.reply, body, headers)
            await client.publish(self.reply, body, reply=probe, headers=headers)

    async def send_error(self, error: ApiError) -> None:
        """The error as a body and as headers: ours, and the NATS service protocol's, which
        micro-service clients read (a description and an HTTP-like status code)."""
        headers = {
            ERROR_HEADER: error.code,
            SERVICE_ERROR_HEADER: error.message.replace("\r", " ").replace("\n", " "),
            SERVICE_ERROR_CODE_HEADER: str(ERROR_STATUS[error.code]),
        }
        await self.send(error.body(), headers)

    async def forward(self, subject: str) -> None:
        """Hand the request on to `subject` as it came: the answer goes to the requester. (A
        reply subject of a tenant's import goes in a header: nats-server refuses it as the
        reply subject of a message a client publishes, but lets one publish to it.)"""
        client = self._bus.client
        headers, reply = self.headers or None, self.reply
        if reply.startswith(IMPORT_REPLY_PREFIX):
            headers, reply = {**self.headers, FORWARDED_REPLY_HEADER: reply}, ""
        check_fits(client, subject, self.data, headers)
        await client.publish(subject, self.data, reply=reply, headers=headers)


Handler = Callable[[Incoming], Awaitable[None]]


def requester(headers: dict[str, str]) -> str | None:
    """The connection that sent a request through a tenant's import, as `server/client-id`
    (the server's name, which is its id unless configured; what `Bus.on_disconnects` reports
    when it closes); None where nats-server said nothing."""
    try:
        info = orjson.loads(headers.get(REQUEST_INFO_HEADER, ""))
        return f"{info['server']}/{info['id']}"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
