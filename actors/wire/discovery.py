"""The NATS service discovery protocol's answers (`$SRV.PING|INFO|STATS[.name[.id]]`), which
`Bus.advertise` sends, so `nats micro list|info|stats pensieve` show every engine with its
endpoints and their request counts, errors and processing times.

nats-py's own `nats.micro` answers these too, but it also runs each endpoint's requests one after
another (its handler is awaited in the subscription's callback), which a streamed turn of several
seconds would hold up; so the endpoints stay the bus's own and only these answers are written
here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

KINDS = ("ping", "info", "stats")


@dataclass(frozen=True)
class ServiceInfo:
    """Who answers on this bus, for NATS service discovery (one engine = one service id)."""

    name: str
    id: str
    version: str
    description: str


@dataclass
class EndpointStats:
    name: str
    subject: str
    queue_group: str
    num_requests: int = 0
    num_errors: int = 0
    last_error: str = ""
    processing_time: int = 0  # ns, over all requests

    def as_json(self) -> dict[str, object]:
        average = self.processing_time // self.num_requests if self.num_requests else 0
        return {**dataclasses.asdict(self), "average_processing_time": average, "data": None}


def subjects(kind: str, service: ServiceInfo) -> tuple[str, ...]:
    """Where a `kind` request reaches `service`: asked of all, of its name, or of it alone."""
    verb = f"$SRV.{kind.upper()}"
    return (verb, f"{verb}.{service.name}", f"{verb}.{service.name}.{service.id}")


def reply(
    kind: str, service: ServiceInfo, endpoints: Iterable[EndpointStats], started: str
) -> dict[str, object]:
    """The answer to a `kind` request (`started`: when the service began, ISO 8601)."""
    body: dict[str, object] = {
        "type": f"io.nats.micro.v1.{kind}_response",
        "name": service.name,
        "id": service.id,
        "version": service.version,
        "metadata": {},
    }
    if kind == "info":
        body["description"] = service.description
        body["endpoints"] = [
            {"name": e.name, "subject": e.subject, "queue_group": e.queue_group, "metadata": None}
            for e in endpoints
        ]
    elif kind == "stats":
        body["started"] = started
        body["endpoints"] = [e.as_json() for e in endpoints]
    return body
