"""Tracing: every actor under a service name of its own, one trace per turn with a span from each
actor the turn crosses, the GenAI semantic-convention attributes on the turn's span, and a
conversation's KV leaving linked to its last turn. The turns run on the real SmolLM2, through
the actors on a real nats-server or a `ChatService` alone, with tiers small enough that history
leaves the GPU."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pensieve.actors.config import StepChannel
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.schemas import parse_chat
from pensieve.ops.factory import EngineOptions, assemble
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.ops.telemetry import setup_tracing
from pensieve.store import ConversationStore, StoreWriter
from tests.ops.serving import serve_on_thread
from tests.ops.test_chat_service import Sink

LONG = " ".join(["Tell me about the history of Paris, its bridges, its museums and its food."] * 8)


class Recorder(InMemorySpanExporter):
    """Keeps every span, and the thread that ended it (the tests export each span at once,
    on that thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[int, str] = {}  # span id -> the name of the thread that ended it

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            self.threads[span.context.span_id] = threading.current_thread().name
        return super().export(spans)


@pytest.fixture
def spans() -> Iterator[Recorder]:
    exporter = Recorder()
    installed = setup_tracing(exporter, engine_id="0123abcd")
    assert installed is not None
    yield exporter
    installed.shutdown()


def service_of(span: ReadableSpan) -> str:
    return str(span.resource.attributes["service.name"])


def attributes_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_each_actor_traces_under_its_own_service(spans) -> None:
    for actor in subjects.ACTORS:
        tracing.tracer(actor).start_span(f"{actor} work").end()
    by_name = {s.name: s.resource.attributes for s in spans.get_finished_spans()}
    for actor in subjects.ACTORS:
        resource = by_name[f"{actor} work"]
        assert resource["service.name"] == f"pensieve-{actor}"
        assert resource["service.instance.id"] == "0123abcd"
        assert resource["service.version"]
    with pytest.raises(ValueError, match="unknown actor"):
        tracing.tracer("planner")


def test_after_shutdown_the_actors_trace_nothing() -> None:
    exporter = InMemorySpanExporter()
    installed = setup_tracing(exporter)
    assert installed is not None
    installed.shutdown()
    span = tracing.tracer("executor").start_span("step")
    assert not span.is_recording()
    span.end()
    assert exporter.get_finished_spans() == ()


@pytest.fixture
def service(smollm2, smollm2_chat, tmp_path: Path) -> Iterator[ChatService]:
    # 8 GPU blocks and 3 CPU blocks of 32 tokens: three conversations of ~180 tokens each push
    # the older ones' history to the CPU tier, and out of it
    options = EngineOptions(
        model="smollm2", gpu_cache_tokens=256, cpu_cache_tokens=96, admission_reserve=0.0
    )
    built = assemble(options, smollm2, smollm2_chat)
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        yield ChatService(built.engine, built.chat, 4096, store, writer)


def turn(service: ChatService, **body: Any) -> tuple[dict[str, Any], trace.SpanContext]:
    """One turn under a request span made as the ingress makes it; its reply and span."""
    reservation = service.reserve(parse_chat(orjson.dumps({"max_tokens": 4, **body})))
    ingress = tracing.tracer("ingress")
    with ingress.start_as_current_span(subjects.CHAT, kind=SpanKind.SERVER) as span:
        sink = Sink()
        service.start(reservation, service.chat.render(reservation.messages), sink, span)
        while service.has_work():
            service.step()
        assert sink.settled.wait(30) and sink.reply is not None
    return sink.reply, span.get_span_context()


def ask(url: str, body: dict[str, Any], traceparent: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        client = await nats.connect(url)
        try:
            data = orjson.dumps({"max_tokens": 4, **body})
            headers = {"traceparent": traceparent}
            msg = await client.request(subjects.CHAT, data, timeout=120, headers=headers)
            return dict(orjson.loads(msg.data))
        finally:
            await client.close()

    return asyncio.run(go())


def finished(spans: InMemorySpanExporter, trace_id: int, names: set[str]) -> list[ReadableSpan]:
    """The trace's finished spans, once those named `names` are among them (the request's
    spans end as its reply goes out)."""
    deadline = time.monotonic() + 10
    while True:
        found = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
        if names <= {s.name for s in found} or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("step_channel", [StepChannel.DIRECT, StepChannel.NATS])
def test_a_turn_is_one_trace_across_the_actors_it_crosses(
    smollm2, smollm2_chat, tmp_path, spans, step_channel
) -> None:
    """Through the actors on a real nats-server: a returning conversation whose history is
    partly on the CPU tier and partly dropped has one trace with spans from all six actors, its
    swap-in and recompute plan among them; and the swap-out and the drop of that history are
    spans linked to the turn before. The executor's and the swap manager's spans of the turn
    are written where the model runs: by the executor actor's threads when the engine steps it
    over NATS, else by the engine thread that runs the model itself. With the step plans over
    NATS the reply's text goes to the tokenizer replicas over NATS too, and the replica that
    decodes the whole reply traces it in the turn's trace."""
    # 8 GPU blocks and 3 CPU blocks of 32 tokens: three conversations of ~180 tokens each push
    # the older ones' history to the CPU tier, and out of it
    options = EngineOptions(
        model="smollm2", gpu_cache_tokens=256, cpu_cache_tokens=96, admission_reserve=0.0
    )
    built = assemble(options, smollm2, smollm2_chat)
    traces = iter(range(0x7E57_0000_0000_0000_0000_0000_0000_0001, 1 << 127))
    with (
        EmbeddedNats() as server,
        serve_on_thread(
            built,
            tmp_path,
            server.url,
            step_channel=step_channel,
            remote_text=step_channel is StepChannel.NATS,
        ),
    ):

        def turn(**body: Any) -> tuple[dict[str, Any], int]:
            trace_id = next(traces)
            return ask(server.url, body, f"00-{trace_id:032x}-{1:016x}-01"), trace_id

        firsts = [turn(message=f"({i}) {LONG}") for i in range(3)]
        before = {reply["conversation_id"]: trace_id for reply, trace_id in firsts}
        for conv_id in reversed(before):
            reply, trace_id = turn(conversation_id=conv_id, message="And of Italy?")
            cached = reply["usage"]["cached_tokens"]
            if cached["cpu"] and cached["recomputed"]:
                break
        else:
            raise AssertionError("no turn brought history back from the CPU tier and recomputed")
        names = {subjects.CHAT, "turn", "kv.swap_in", "kv.plan_recompute", "decode"}
        spans_of_turn = finished(spans, trace_id, names)
    assert {service_of(s) for s in spans_of_turn} == {
        "pensieve-ingress",
        "pensieve-tokenizer",
        "pensieve-scheduler",
        "pensieve-recompute-planner",
        "pensieve-executor",
        "pensieve-swap-manager",
    }
    by_name = {s.name: s for s in spans_of_turn}
    request, turn_span = by_name[subjects.CHAT], by_name["turn"]
    assert turn_span.parent is not None and turn_span.parent.span_id == request.context.span_id
    for name in (
        "tokenizer.render",
        "kv.plan_recompute",
        "queued",
        "prefill",
        "decode",
        "kv.swap_in",
    ):
        assert by_name[name].parent.span_id == turn_span.context.span_id, name  # type: ignore[union-attr]
    assert service_of(by_name["queued"]) == "pensieve-scheduler"
    assert service_of(by_name["prefill"]) == service_of(by_name["decode"]) == "pensieve-executor"
    executor_side = {
        spans.threads[by_name[name].context.span_id] for name in ("prefill", "decode", "kv.swap_in")
    }
    if step_channel is StepChannel.NATS:  # the worker or the reporter of the executor actor
        assert all(name.startswith("pensieve-executor") for name in executor_side), executor_side
    else:
        assert executor_side == {"pensieve-engine"}
    assert spans.threads[by_name["queued"].context.span_id] == "pensieve-engine"
    if step_channel is StepChannel.NATS:
        detokenize = by_name["tokenizer.detokenize"]
        assert service_of(detokenize) == "pensieve-tokenizer"
        assert detokenize.parent.span_id == turn_span.context.span_id  # type: ignore[union-attr]
        assert spans.threads[detokenize.context.span_id].startswith("pensieve-detokenizer")
    queued, prefill, decode = by_name["queued"], by_name["prefill"], by_name["decode"]
    times = [
        request.start_time,
        turn_span.start_time,
        queued.start_time,
        queued.end_time,
        prefill.start_time,
        prefill.end_time,
        decode.start_time,
        decode.end_time,
        turn_span.end_time,
    ]
    assert times == sorted(times)  # type: ignore[type-var]

    swap_in = attributes_of(by_name["kv.swap_in"])
    block = built.engine.cache_config.block_size
    assert swap_in["pensieve.blocks"] * block >= cached["cpu"] > 0
    assert swap_in["pensieve.bytes"] == swap_in["pensieve.blocks"] * built.engine.block_bytes
    planned = attributes_of(by_name["kv.plan_recompute"])
    assert planned["pensieve.recomputed_tokens"] == cached["recomputed"]

    evicted = {
        s.name
        for s in spans.get_finished_spans()
        if attributes_of(s).get("pensieve.conversation_id") == conv_id
        and [link.context.trace_id for link in s.links] == [before[conv_id]]
    }
    assert {"kv.swap_out", "kv.drop"} <= evicted, evicted


@pytest.mark.slow
def test_the_request_span_carries_the_genai_attributes(service, spans) -> None:
    reply, context = turn(
        service,
        message="What is the capital of France?",
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        seed=11,
    )
    request = next(s for s in spans.get_finished_spans() if s.context == context)
    attributes = attributes_of(request)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "pensieve"
    assert attributes["gen_ai.conversation.id"] == reply["conversation_id"]
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.temperature"] == 0.7
    assert attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.seed"] == 11
    assert attributes["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == (reply["finish_reason"],)


@pytest.mark.slow
def test_kv_leaving_an_idle_conversation_is_linked_to_its_last_turn(service, spans) -> None:
    first, _ = turn(service, message="What is the capital of France?")
    conv_id = first["conversation_id"]
    _, last = turn(service, conversation_id=conv_id, message="And of Italy?")
    service.trace_evictions({conv_id: 3}, {conv_id: 1, "c-unknown": 2})
    evictions = {
        (s.name, attributes_of(s)["pensieve.conversation_id"]): s
        for s in spans.get_finished_spans()
        if s.name.startswith("kv.")
    }
    assert set(evictions) == {
        ("kv.swap_out", conv_id),
        ("kv.drop", conv_id),
        ("kv.drop", "c-unknown"),
    }
    for name, chunks in (("kv.swap_out", 3), ("kv.drop", 1)):
        span = evictions[name, conv_id]
        assert service_of(span) == "pensieve-swap-manager"
        assert span.parent is None and span.context.trace_id != last.trace_id  # a trace of its own
        assert [link.context for link in span.links] == [last]
        assert attributes_of(span)["pensieve.chunks"] == chunks
    assert evictions["kv.drop", "c-unknown"].links == ()  # no turn of it seen here
