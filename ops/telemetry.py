"""The one place that configures OpenTelemetry (the actors only use the API, a no-op until this
runs).

Every actor traces under a service of its own (`pensieve-ingress`, `pensieve-tokenizer`,
`pensieve-scheduler`, `pensieve-recompute-planner`, `pensieve-executor`,
`pensieve-swap-manager`): one tracer provider per actor, all sharing one exporter, installed for
the actors in `actors.tracing`.

`pensieve serve --trace otlp` sends spans over OTLP/HTTP to `OTEL_EXPORTER_OTLP_ENDPOINT`
(default http://localhost:4318, e.g. Jaeger; needs the `otlp` extra: `pip install -e ".[otlp]"`);
`--trace console` prints them; tests pass an exporter of their own.
"""

from __future__ import annotations

import atexit
import uuid
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)

from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.version import version

TRACE_CHOICES = ("none", "console", "otlp")


@dataclass(frozen=True)
class Tracing:
    """The actors' tracer providers (by actor name) and the one processor they export through."""

    providers: dict[str, TracerProvider]
    processor: SpanProcessor

    def shutdown(self) -> None:
        """Export the spans still batched and stop; the actors go back to no-op tracers."""
        tracing.uninstall()
        atexit.unregister(self.shutdown)
        self.processor.shutdown()  # once for all providers: they share it


def setup_tracing(kind: str | SpanExporter, engine_id: str | None = None) -> Tracing | None:
    """Trace every actor to `kind` under its own service name; None for "none".
    `engine_id` names the service instance (a random id per process without it)."""
    if kind == "none":
        return None
    processor = _processor(kind)
    instance = engine_id or uuid.uuid4().hex
    providers = {}
    for actor in subjects.ACTORS:
        resource = Resource.create(
            {
                "service.name": subjects.actor_service(actor),
                "service.namespace": subjects.SERVICE,
                "service.instance.id": instance,
                "service.version": version(),
            }
        )
        # one exit hook for all (`Tracing.shutdown`), not one per provider
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(processor)
        providers[actor] = provider
    tracing.install(providers)
    installed = Tracing(providers, processor)
    atexit.register(installed.shutdown)
    return installed


def _processor(kind: str | SpanExporter) -> SpanProcessor:
    if isinstance(kind, SpanExporter):  # tests: every span at once, in order
        return SimpleSpanProcessor(kind)
    if kind == "console":
        return BatchSpanProcessor(ConsoleSpanExporter())
    if kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                "--trace otlp needs the OTLP exporter: "
                "pip install opentelemetry-exporter-otlp-proto-http"
            ) from None
        return BatchSpanProcessor(OTLPSpanExporter())
    raise ValueError(f"unknown trace exporter {kind!r}; choose from {TRACE_CHOICES}")
