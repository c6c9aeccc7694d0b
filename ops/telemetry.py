"""The one place that configures OpenTelemetry (the actors only use the API, a no-op until this
runs).

`pensieve serve --trace otlp` sends spans over OTLP/HTTP to `OTEL_EXPORTER_OTLP_ENDPOINT`
(default http://localhost:4318, e.g. Jaeger; needs the `otlp` extra: `pip install -e ".[otlp]"`);
`--trace console` prints them; tests pass an exporter of their own.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)

TRACE_CHOICES = ("none", "console", "otlp")


def setup_tracing(
    kind: str | SpanExporter, service_name: str = "pensieve"
) -> TracerProvider | None:
    """Install a global tracer provider exporting to `kind`; None for "none"."""
    if kind == "none":
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if isinstance(kind, SpanExporter):  # tests: every span at once, in order
        provider.add_span_processor(SimpleSpanProcessor(kind))
    elif kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                "--trace otlp needs the OTLP exporter: "
                "pip install opentelemetry-exporter-otlp-proto-http"
            ) from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        raise ValueError(f"unknown trace exporter {kind!r}; choose from {TRACE_CHOICES}")
    trace.set_tracer_provider(provider)
    return provider
