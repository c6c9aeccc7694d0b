"""Tracing: every actor under a service name of its own, one trace per turn with a span from each
actor the turn crosses, the GenAI semantic-convention attributes on the turn's span, a turn's
suspensions as events on it, the copies of KV as spans as long as the copies, written where
they run, and a conversation's KV leaving linked to its last turn. The turns run on the real
SmolLM2, through the actors on a real nats-server or a `ChatService` alone, with tiers small
enough that history leaves the GPU."""

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
from pensieve.actors.wire.request_parsing import parse_chat
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
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


def duration_s(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


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
        yield ChatService(built.engine, built.chat, 4096, store, writer, model="smollm2")


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
            sources = reply["usage"]["prompt_sources"]
            if sources["cpu"] and sources["recomputed"]:
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

    assert service_of(by_name["kv.swap_in"]) == "pensieve-swap-manager"
    assert 0 < duration_s(by_name["kv.swap_in"]) < duration_s(prefill)  # the copies alone
    swap_in = attributes_of(by_name["kv.swap_in"])
    block = built.engine.cache_config.block_size
    assert swap_in["pensieve.blocks"] * block >= sources["cpu"] > 0
    assert swap_in["pensieve.bytes"] == swap_in["pensieve.blocks"] * built.engine.block_bytes
    assert swap_in["pensieve.conversation_id"] == conv_id
    planned = attributes_of(by_name["kv.plan_recompute"])
    assert planned["pensieve.recomputed_tokens"] == sources["recomputed"]

    evicted = [
        s
        for s in spans.get_finished_spans()
        if attributes_of(s).get("pensieve.conversation_id") == conv_id
        and [link.context.trace_id for link in s.links] == [before[conv_id]]
    ]
    assert {"kv.swap_out", "kv.drop"} <= {s.name for s in evicted}, evicted
    # the copies are the swap manager's, written where they ran and as long as they took; a
    # drop moves nothing: the scheduler's cache manager decided it
    for span in evicted:
        if span.name == "kv.swap_out":
            assert service_of(span) == "pensieve-swap-manager"
            assert duration_s(span) > 0
            thread = spans.threads[span.context.span_id]
            if step_channel is StepChannel.NATS:
                assert thread.startswith("pensieve-executor"), thread
            else:
                assert thread == "pensieve-engine"
        else:
            assert service_of(span) == "pensieve-scheduler"


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
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == "smollm2"
    assert attributes["gen_ai.conversation.id"] == reply["conversation_id"]
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.temperature"] == 0.7
    assert attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.seed"] == 11
    assert attributes["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == (reply["finish_reason"],)


@pytest.mark.slow
def test_kv_copied_out_of_an_idle_conversation_is_timed_and_linked_to_its_last_turn(
    service, spans
) -> None:
    first, last = turn(service, message=f"(0) {LONG}")
    conv_id = first["conversation_id"]
    for i in (1, 2):  # their KV pushes the first conversation's history out of the GPU
        turn(service, message=f"({i}) {LONG}")
    copied = [
        s
        for s in spans.get_finished_spans()
        if s.name == "kv.swap_out" and attributes_of(s)["pensieve.conversation_id"] == conv_id
    ]
    assert copied
    for span in copied:
        assert service_of(span) == "pensieve-swap-manager"
        assert span.parent is None and span.context.trace_id != last.trace_id  # a trace of its own
        linked = [(link.context.trace_id, link.context.span_id) for link in span.links]
        assert linked == [(last.trace_id, last.span_id)]
        assert duration_s(span) > 0  # the copies' own time
        blocks = attributes_of(span)["pensieve.blocks"]
        assert attributes_of(span)["pensieve.bytes"] == blocks * service.engine.block_bytes > 0


@pytest.mark.slow
def test_kv_dropped_from_an_idle_conversation_is_linked_to_its_last_turn(service, spans) -> None:
    first, _ = turn(service, message="What is the capital of France?")
    conv_id = first["conversation_id"]
    _, last = turn(service, conversation_id=conv_id, message="And of Italy?")
    service.trace_drops({conv_id: 1, "c-unknown": 2})
    drops = {
        attributes_of(s)["pensieve.conversation_id"]: s
        for s in spans.get_finished_spans()
        if s.name == "kv.drop"
    }
    assert set(drops) == {conv_id, "c-unknown"}
    span = drops[conv_id]
    assert service_of(span) == "pensieve-scheduler"
    assert span.parent is None and span.context.trace_id != last.trace_id  # a trace of its own
    assert [link.context for link in span.links] == [last]
    assert attributes_of(span)["pensieve.chunks"] == 1
    assert drops["c-unknown"].links == ()  # no turn of it seen here


@pytest.mark.slow
def test_a_suspended_turn_has_an_event_and_its_copies_are_spans_in_its_trace(
    smollm2, smollm2_chat, tmp_path, spans
) -> None:
    """Two turns that outgrow the GPU tier together: the later one is suspended (its KV copied
    to the CPU tier) and resumes (copied back). Its span holds the suspension as an event, and
    its trace the copies, each span as long as the host took to copy (what the swap totals
    count)."""
    # 7 GPU blocks of 32 tokens: two short turns fit, but not their replies (5 blocks each)
    options = EngineOptions(
        model="smollm2", gpu_cache_tokens=224, cpu_cache_tokens=256, admission_reserve=0.0
    )
    built = assemble(options, smollm2, smollm2_chat)
    with ConversationStore(tmp_path) as store, StoreWriter() as writer:
        service = ChatService(built.engine, built.chat, 4096, store, writer, model="smollm2")
        ingress = tracing.tracer("ingress")
        sinks, contexts = [], []
        for message in ("What is the capital of France?", "And of Italy?"):
            body = {"message": message, "max_tokens": 96, "ignore_eos": True}
            reservation = service.reserve(parse_chat(orjson.dumps(body)))
            span = ingress.start_span(subjects.CHAT, kind=SpanKind.SERVER)
            sinks.append(Sink())
            service.start(reservation, service.chat.render(reservation.messages), sinks[-1], span)
            contexts.append(span)
        while service.has_work():
            service.step()
        for sink, span in zip(sinks, contexts, strict=True):
            assert sink.settled.wait(30) and sink.reply is not None
            span.end()
        swaps = built.engine.swap_stats()
    assert built.engine.num_suspensions >= 1
    finished_spans = spans.get_finished_spans()
    suspended = [
        s
        for s in finished_spans
        if s.name == subjects.CHAT and attributes_of(s)["pensieve.suspensions"]
    ]
    assert len(suspended) == 1
    (request,) = suspended
    assert attributes_of(request)["gen_ai.request.model"] == "smollm2"
    events = [e for e in request.events if e.name == "suspended"]
    assert len(events) == attributes_of(request)["pensieve.suspensions"]
    copied_out = sum(int((e.attributes or {})["pensieve.swapped_out_blocks"]) for e in events)
    assert (
        copied_out
        == attributes_of(request)["pensieve.swapped_out_bytes"] // built.engine.block_bytes
    )
    assert copied_out > 0
    assert all(request.start_time < e.timestamp < request.end_time for e in events)  # type: ignore[operator]
    in_turn = [
        s
        for s in finished_spans
        if s.parent is not None and s.parent.span_id == request.context.span_id
    ]
    out = [s for s in in_turn if s.name == "kv.swap_out"]
    back = [s for s in in_turn if s.name == "kv.swap_in"]
    assert out and back
    assert sum(attributes_of(s)["pensieve.blocks"] for s in out) == copied_out
    assert all(attributes_of(s)["pensieve.evict_first"] for s in out)
    assert all(duration_s(s) > 0 for s in out + back)
    assert events[0].timestamp <= min(s.start_time for s in out)  # type: ignore[operator]
    assert max(s.end_time for s in out) <= min(s.start_time for s in back)  # type: ignore[operator]
    # every copy of the run is a span as long as the host took to make it (one window per
    # kind and step, shared by the conversations whose chunks it moved)
    windows: dict[str, set[tuple[int, int]]] = {"kv.swap_in": set(), "kv.swap_out": set()}
    for span in finished_spans:
        if span.name in windows:
            windows[span.name].add((span.start_time, span.end_time))  # type: ignore[arg-type]
    took = {name: sum(end - start for start, end in w) / 1e9 for name, w in windows.items()}
    assert took["kv.swap_in"] == pytest.approx(swaps.seconds_in, abs=1e-5)
    assert took["kv.swap_out"] == pytest.approx(swaps.seconds_out, abs=1e-5)
