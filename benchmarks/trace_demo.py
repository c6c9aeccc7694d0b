r"""Drive a `pensieve serve --trace otlp` so that one turn's trace shows its history coming back
from the CPU tier, and print that turn's trace id.

Serve with tiers too small for the conversations (see docs/tracing.md), e.g.

    pensieve serve --insecure --model smollm2 --trace otlp --gpu-cache-tokens 256 \
        --cpu-cache-tokens 96 --admission-reserve 0

then run `python benchmarks/trace_demo.py`. It starts three conversations with a long first
message, so the older ones' history is swapped out to the CPU tier and partly dropped, then
returns to them newest first until a turn gets history back from the CPU tier (`kv.swap_in`), at
best with some recomputed too (`kv.plan_recompute`). Each turn runs under a client span of its
own (service `pensieve-trace-demo`) whose W3C `traceparent` goes in the NATS headers, so the
engine's spans join its trace; the client's spans go to $OTEL_EXPORTER_OTLP_ENDPOINT as the
engine's do (if the OTLP exporter is installed; the trace id is known either way).

Prints one JSON line: the returning turn's `trace_id`, its usage, and `previous_trace_id`, the
conversation's turn before, to which the `kv.swap_out` / `kv.drop` spans of its history link.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import nats
import orjson
from opentelemetry import propagate
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Tracer, format_trace_id

LONG = " ".join(["Tell me about the history of Paris, its bridges, its museums and its food."] * 8)


def client_tracer() -> tuple[TracerProvider, Tracer]:
    provider = TracerProvider(resource=Resource.create({"service.name": "pensieve-trace-demo"}))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        print("no OTLP exporter: the client's own spans are not sent", file=sys.stderr)
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider, provider.get_tracer("pensieve.trace_demo")


async def turn(nc: Any, tracer: Tracer, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """One chat turn under a client span; its reply and its trace id (hex)."""
    with tracer.start_as_current_span("chat turn", kind=SpanKind.CLIENT) as span:
        headers: dict[str, str] = {}
        propagate.inject(headers)  # traceparent: the engine's spans join this trace
        msg = await nc.request(
            "pensieve.v1.chat",
            orjson.dumps({"max_tokens": 8, **body}),
            timeout=300,
            headers=headers,
        )
        reply = orjson.loads(msg.data)
        if msg.headers and "Pensieve-Error" in msg.headers:
            raise RuntimeError(reply["error"])
        span.set_attribute("pensieve.conversation_id", reply["conversation_id"])
        return reply, format_trace_id(span.get_span_context().trace_id)


async def main() -> None:
    parser = argparse.ArgumentParser(description="One turn's trace with a swap-in; prints its id.")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--conversations", type=int, default=3, help="started before returning")
    args = parser.parse_args()
    provider, tracer = client_tracer()
    nc = await nats.connect(args.nats_url)
    try:
        firsts = [
            await turn(nc, tracer, {"message": f"({i}) {LONG}"}) for i in range(args.conversations)
        ]
        found = None
        for first, first_trace in reversed(firsts):
            body = {"conversation_id": first["conversation_id"], "message": "And of Italy?"}
            reply, trace_id = await turn(nc, tracer, body)
            cached = reply["usage"]["prompt_sources"]
            if cached["cpu"] and (found is None or cached["recomputed"]):
                found = {
                    "trace_id": trace_id,
                    "previous_trace_id": first_trace,
                    "conversation_id": reply["conversation_id"],
                    "usage": reply["usage"],
                }
            if found is not None and cached["recomputed"]:
                break
    finally:
        await nc.close()
        provider.shutdown()  # send the client's spans still batched
    if found is None:
        sys.exit("no turn brought history back from the CPU tier: are the tiers small enough?")
    print(orjson.dumps(found).decode())


if __name__ == "__main__":
    asyncio.run(main())
