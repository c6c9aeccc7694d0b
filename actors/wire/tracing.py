"""Each actor's tracer, through the OpenTelemetry API only.

A turn's trace holds spans from every actor it crosses, each under the actor's own service
(`pensieve-ingress`, `pensieve-executor`, ...), also where several actors share one process. A
tracer provider carries one service name, so `ops.telemetry.setup_tracing` makes one provider
per actor and installs their tracers here; until it does (or after its `shutdown`), every
actor traces through the global API tracer, a no-op unless something else configured it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pensieve.actors.wire import subjects
from pensieve.actors.wire.version import version

if TYPE_CHECKING:
    from pensieve.actors.wire.schemas import ApiError

_tracers: dict[str, trace.Tracer] = {}  # replaced whole, never changed in place
_W3C = TraceContextTextMapPropagator()


def tracer(actor: str) -> trace.Tracer:
    """The tracer whose spans are `actor`'s (one of `subjects.ACTORS`)."""
    found = _tracers.get(actor)
    if found is not None:
        return found
    if actor not in subjects.ACTORS:
        raise ValueError(f"unknown actor {actor!r}; one of {', '.join(subjects.ACTORS)}")
    return trace.get_tracer(f"pensieve.{actor}")


def enabled() -> bool:
    """Whether spans go anywhere (callers skip work that only feeds spans otherwise)."""
    return bool(_tracers)


def install(providers: Mapping[str, trace.TracerProvider]) -> None:
    """Trace each actor through its provider (every actor of `subjects.ACTORS` needs one)."""
    global _tracers
    missing = set(subjects.ACTORS) - set(providers)
    if missing:
        raise ValueError(f"no tracer provider for {', '.join(sorted(missing))}")
    _tracers = {a: providers[a].get_tracer(f"pensieve.{a}", version()) for a in subjects.ACTORS}


def uninstall() -> None:
    """Back to the global API tracer for every actor."""
    global _tracers
    _tracers = {}


def record_refusal(span: trace.Span, error: ApiError) -> None:
    """Mark `span` as the work of a request refused with `error` (its code as an attribute)."""
    span.set_attribute("pensieve.error", error.code)
    span.set_status(Status(StatusCode.ERROR, error.message))


def traceparent(span: trace.Span) -> str:
    """`span`'s W3C trace context, as a `traceparent` header holds it ("" for a span that is
    not recording): what a message carries so that another actor's spans join its trace."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def parent_context(traceparent: str) -> Context:
    """The context whose spans are children of the span `traceparent` names (a fresh trace for
    "" or a malformed one)."""
    return _W3C.extract({"traceparent": traceparent})
