"""The scheduler actor's async shell: NATS subjects in, the engine on a thread of its own.

`ChatServer` takes the client requests the ingress hands over (`actors/ingress/`) on the
scheduler's internal subjects, has the chat template rendered by a tokenizer replica
(`actors/tokenizer/actor.py`), hands the turn to the engine thread (`engine_thread.py`, which
owns the `ChatService`), and sends replies (or streamed deltas) straight to the client's inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

import msgspec
import orjson
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from pensieve.actors.config import DEFAULT_EXPIRY, DEFAULTS, ExpiryConfig
from pensieve.actors.scheduler.chat_service import ChatService, Reservation
from pensieve.actors.scheduler.engine_thread import EngineThread, ReplySink
from pensieve.actors.scheduler.kv.kv_events import KvEventStream
from pensieve.actors.scheduler.load_reporter import load_report, reporting_load
from pensieve.actors.scheduler.ownership import Ownership
from pensieve.actors.scheduler.step_log import StepLog
from pensieve.actors.scheduler.sweeper import sweeping
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.calls import (
    RENDER_TIMEOUT_S,
    detokenize_remote,
    plan_remote,
    render_remote,
)
from pensieve.actors.wire.incoming import REQUESTER_HEADER, TENANT_HEADER, Handler, Incoming
from pensieve.actors.wire.messages import DetokenizeRequest, KvEvent, encode_kv_events
from pensieve.actors.wire.replies import CancelReply, ChatDelta, CreateReply, DeleteReply
from pensieve.actors.wire.request_parsing import encode_body, read_checked
from pensieve.actors.wire.schemas import (
    ApiError,
    ChatRequest,
    ConversationRef,
    CreateBody,
    GetRequest,
    Page,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
STATS_WAIT_S = 0.05  # how long a stats request waits for the engine thread, then its snapshot
PROBE_EVERY_S = 0.5  # a streamed turn's deltas ask NATS whether its inbox is there this often
CLOSE_REPLIES_S = 5.0  # how long the `unavailable` answers of a stop get to go out


class ChatServer(Actor):
    """The engine thread (on `cpu_threads` PyTorch threads) runs while the actor does; the
    expiry sweeper deletes conversations idle past their TTL (`expiry`).

    With `remote_text`, reply tokens go to the tokenizer actor for their text; otherwise the
    engine thread finds it with the same core (`ChatService.detokenize`).

    A turn whose requester goes away is cancelled (`ChatService.abandon`). A streamed turn's
    deltas carry a probe as their reply subject (`Bus.on_no_responders`), at most every
    PROBE_EVERY_S: once nobody listens on its inbox, NATS says so. A tenant's inbox lies in
    another account, where NATS says nothing of the kind; there, with `events` (a connection
    of the system account, which the actor closes when it stops), the closing of the tenant's
    connection ends its turns, streamed or not. A turn of the service's own account that is
    not streamed has no probe (any message would be taken for its reply): its `timeout_s`
    bounds it."""

    name: ClassVar[str] = "scheduler"
    description: ClassVar[str] = (
        "admission, the unified batch, KV accounting and eviction; plans every step"
    )

    def __init__(
        self,
        bus: Bus,
        engine_id: str,
        service: ChatService,
        *,
        cpu_threads: int | None = None,
        remote_text: bool = True,
        events: Bus | None = None,
        expiry: ExpiryConfig = DEFAULT_EXPIRY,
        grace_s: float = DEFAULTS.shutdown_grace_s,
        ownership: Ownership | None = None,
    ) -> None:
        super().__init__(bus, engine_id)
        # one scheduler per engine: its service instance is the engine (the HTTP ingress's
        # /health pings it by the engine id)
        self.instance_id = engine_id
        self.service = service
        self.cpu_threads = cpu_threads
        self.remote_text = remote_text
        self.events = events
        self.expiry = expiry
        self.grace_s = grace_s
        # with many engines: the lease, the conversations held and the replicated turn log
        self.ownership = ownership
        self._engine: EngineThread | None = None
        self._sweeping: contextlib.AsyncExitStack | None = None
        self._kv_stream = KvEventStream(engine_id)  # this process's KV event batches
        self._sends: set[asyncio.Task[None]] = set()  # see `_send`
        self._detokenizing: set[asyncio.Task[None]] = set()
        self._probes = ""  # the prefix of this connection's probe subjects
        self._num_probes = 0
        self._probed: dict[str, ReplySink] = {}  # probe subject -> its turn's sink
        self._by_requester: dict[str, set[ReplySink]] = {}  # tenant connection -> its turns

    @property
    def engine(self) -> EngineThread:
        """The thread that steps the engine (while the actor runs)."""
        if self._engine is None:
            raise ApiError("unavailable", "the scheduler is not running")
        return self._engine

    async def start(self) -> None:
        """Start the engine thread, then take the requests the ingress hands to this engine's
        scheduler (see `actors/ingress/actor.py`), each answered to its client directly; returns
        once subscribed, so a request sent now is answered (idempotent)."""
        try:
            await super().start()
        except BaseException:
            await self.stop(0.0)
            raise

    async def setup(self) -> None:
        self._engine = EngineThread(self.service, self.cpu_threads)
        await self._call(self._publish_kv_events, asyncio.get_running_loop())
        self._probes = await self.bus.on_no_responders(self._inbox_gone)
        if self.events is not None:
            await self.events.on_disconnects(self._requester_gone)
            await self.events.flush()
        if self.remote_text:
            await self._call(self._detokenize_remotely, asyncio.get_running_loop())
        if self.ownership is not None:
            await self.ownership.start()
            await self._call(self._replicate_turns, asyncio.get_running_loop())
        handlers: dict[str, Handler] = {
            "chat": self._chat,
            "cancel": self._cancel,
            "get": self._get,
            "delete": self._delete,
            "list": self._list,
            "create": self._create,
            "stats": self._stats,
        }
        for verb, handler in handlers.items():
            await self.bus.serve(self.subject(verb), handler, queue=self.name, handoff=True)
        # asked directly (not handed off) by an HTTP ingress in another process
        await self.serve("metrics", self._metrics)
        self._sweeping = contextlib.AsyncExitStack()
        await self._sweeping.enter_async_context(sweeping(self.engine, self.expiry))
        await self._sweeping.enter_async_context(watching_loop(self.service.step_log))
        await self._sweeping.enter_async_context(
            reporting_load(self.bus, self.engine_id, lambda: self.engine.snapshot)
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Draining stop: take no more requests, give those in hand `grace_s` (default: the
        actor's `grace_s`) to finish, answer what is left `unavailable` (every requester gets a
        final message, nobody waits out a timeout), stop the engine thread, leave the bus."""
        await super().stop(self.grace_s if grace_s is None else grace_s)

    async def teardown(self) -> None:
        if self._sweeping is not None:
            await self._sweeping.aclose()
        try:
            left = await self.bus.settle(0.0)
            if self._engine is not None and left:
                await self._close_turns(left)
            if self.ownership is not None:  # its turns are done: other engines take over
                await self.ownership.release()
            if self.events is not None:
                await self.events.close()
        finally:  # off the event loop: a step in hand may need it to reach the executor
            if self._engine is not None:
                await asyncio.to_thread(self._engine.stop)

    async def _close_turns(self, left: int) -> None:
        """Answer the turns still in hand `unavailable`."""
        logger.info(
            "%d requests still running after the grace period; answering them unavailable", left
        )
        closed = ApiError("unavailable", "the server is shutting down; send the turn again")
        with contextlib.suppress(ApiError):  # a broken engine answers every turn itself
            await self._call(self.service.close, closed)
        await self.bus.settle(CLOSE_REPLIES_S)  # their error replies go out

    def _publish_kv_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: from now on each step's KV events go out on this engine's KV
        subject. A batch is numbered and encoded on the engine thread, in step order, and sent
        from the event loop."""

        def publish(events: list[KvEvent]) -> None:
            body = encode_kv_events(self._kv_stream.batch(events))
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to send to
                loop.call_soon_threadsafe(self._send, subjects.kv_events(self.engine_id), body)

        self.service.publish_kv = publish

        def publish_load() -> None:  # this engine's load now, sent as the KV events are
            report = load_report(self.engine_id, self.service.engine.load(), time.time())
            with contextlib.suppress(RuntimeError):
                subject = subjects.engine_load(self.engine_id)
                loop.call_soon_threadsafe(self._send, subject, report.encode())

        self.service.publish_load = publish_load

    def _detokenize_remotely(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: from now on the reply tokens go to this engine's tokenizer
        replicas for their text, and each answer comes back to the engine thread."""

        def send(request: DetokenizeRequest) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to answer
                loop.call_soon_threadsafe(self._send_text, request)

        self.service.detokenize = send
        self.service.take_text = self.engine.take_text

    def _replicate_turns(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: from now on every store write of a conversation goes to its
        replicated log first (`Ownership.append`, on the event loop)."""
        ownership = self.ownership
        assert ownership is not None

        def replicate(conv_id: str, entry: bytes) -> Future[Any]:
            try:
                return asyncio.run_coroutine_threadsafe(ownership.append(conv_id, entry), loop)
            except RuntimeError as closed:  # the loop is closed: the turn cannot be stored
                failed: Future[Any] = Future()
                failed.set_exception(closed)
                return failed

        self.service.replicate_to(replicate)

    async def _hold(self, conv_id: str | None, tenant: str | None) -> None:
        """With many engines: make sure this engine holds the conversation (it adopts one whose
        owner's lease lapsed), before anything of it is read or written."""
        if self.ownership is not None and conv_id is not None:
            await self.ownership.hold(conv_id, tenant, self._drop)

    async def _drop(self, conv_id: str) -> bool:
        return await self._call(self.service.drop, conv_id)

    def _send_text(self, request: DetokenizeRequest) -> None:
        task = asyncio.ensure_future(self._detokenize(request))
        self._detokenizing.add(task)
        task.add_done_callback(self._detokenizing.discard)

    async def _detokenize(self, request: DetokenizeRequest) -> None:
        service = self.service
        try:
            try:
                reply = await detokenize_remote(self.bus, self.engine_id, request, RENDER_TIMEOUT_S)
            except ApiError as error:
                await self._call(service.text_failed, request, error)
            else:
                await asyncio.wrap_future(self.engine.call_text(service.apply_text, reply))
        except ApiError as broken:  # the engine thread takes no more calls: it answered all
            logger.debug("a reply's text was not applied: %s", broken)

    def _send(self, subject: str, body: bytes) -> None:
        """Publish from the event loop what the engine thread hands over (its KV event batches,
        its load reports). Tasks start in the order they are made, and each hands its message
        to the client before it first waits, so messages leave in the engine thread's order."""
        task = asyncio.ensure_future(self._publish(subject, body))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _publish(self, subject: str, body: bytes) -> None:
        try:
            await self.bus.publish(subject, body)
        except Exception as error:  # shutting down: subscribers see the gap in seq
            logger.debug("not sent on %s: %s", subject, error)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.wrap_future(self.engine.call(fn, *args))

    async def _chat(self, msg: Incoming) -> None:
        parent = propagate.extract(msg.headers)  # the ingress's span of the request
        scheduler = tracing.tracer("scheduler")
        with scheduler.start_as_current_span(
            "turn", context=parent, kind=SpanKind.SERVER, record_exception=False
        ) as span:
            try:
                await self._chat_turn(msg, span)
            except ApiError as error:
                tracing.record_refusal(span, error)
                raise

    async def _chat_turn(self, msg: Incoming, span: trace.Span) -> None:
        sink = ReplySink(asyncio.get_running_loop())
        # a tenant's inbox is in another account, where a probe tells nothing (see the class)
        probing = _tenant(msg) is None
        with self._watching(sink, msg.headers.get(REQUESTER_HEADER), probing) as probe:
            await self._run_turn(msg, span, sink, probe)

    async def _run_turn(self, msg: Incoming, span: trace.Span, sink: ReplySink, probe: str) -> None:
        request = read_checked(msg.data, ChatRequest)  # checked by the ingress
        service = self.service
        await self._hold(request.conversation_id, _tenant(msg))
        reservation = await self._call(service.reserve, request, _tenant(msg))
        # rendered in a tokenizer replica (this engine's), not between two engine steps; the
        # recompute planner is asked meanwhile, for a conversation with history
        longest = service.max_context - 1  # a prompt leaves room for one token at least
        render = _render(self.bus, self.engine_id, reservation, longest)
        try:
            if reservation.new:
                prompt, plan = await render, None
            else:
                conv_id = reservation.conv.conv_id
                prompt, plan = await asyncio.gather(
                    render, plan_remote(self.bus, self.engine_id, conv_id)
                )
        except BaseException:  # a template's refusal is invalid_request, a lost replica unavailable
            self.engine.call(service.release, reservation)
            raise
        planned = plan.ranges if plan is not None and plan.known else None
        conv_id = reservation.conv.conv_id
        await self._call(service.start, reservation, prompt, sink, span, planned)
        if sink.abandoned:  # before it started
            self.engine.call(service.abandon, sink)
        probed_at = -math.inf
        while True:
            kind, value = await sink.next()
            if kind == "delta":
                if not request.stream:
                    continue
                now = time.monotonic()
                asking = probe if now - probed_at >= PROBE_EVERY_S else ""
                probed_at = now if asking else probed_at
                # with the id: a new conversation's turn can be cancelled
                delta = encode_body(ChatDelta(value[0], conv_id, value[1]))
                await msg.send(delta, probe=asking)
            elif kind == "error":
                raise value
            else:
                await msg.send(orjson.dumps({**value, "done": True} if request.stream else value))
                return

    @contextlib.contextmanager
    def _watching(self, sink: ReplySink, requester: str | None, probing: bool) -> Iterator[str]:
        """While the turn answering to `sink` is in hand: with `probing`, its probe subject (see
        the class; else ""), and its requester's connection (a tenant's), watched for
        closing."""
        self._num_probes += 1
        probe = f"{self._probes}.{self._num_probes}" if probing else ""
        if probe:
            self._probed[probe] = sink
        if requester is not None:
            self._by_requester.setdefault(requester, set()).add(sink)
        try:
            yield probe
        finally:
            self._probed.pop(probe, None)
            if requester is not None:
                sinks = self._by_requester[requester]
                sinks.discard(sink)
                if not sinks:
                    del self._by_requester[requester]

    def _inbox_gone(self, probe: str) -> None:
        sink = self._probed.get(probe)
        if sink is not None:
            self._abandon(sink)

    def _requester_gone(self, requester: str) -> None:
        for sink in self._by_requester.get(requester, ()):
            self._abandon(sink)

    def _abandon(self, sink: ReplySink) -> None:
        """Cancel the turn answering to `sink`; one not started yet is, once it starts."""
        sink.abandoned = True
        self.engine.call(self.service.abandon, sink)

    async def _cancel(self, msg: Incoming) -> None:
        conv_id = read_checked(msg.data, ConversationRef).conversation_id
        cancelled = await self._call(self.service.cancel, conv_id, _tenant(msg))
        await msg.send(encode_body(CancelReply(conv_id, cancelled)))

    async def _get(self, msg: Incoming) -> None:
        request = read_checked(msg.data, GetRequest)
        service, conv_id = self.service, request.conversation_id
        await self._hold(conv_id, _tenant(msg))
        # off the engine thread: a read never waits for a step to end
        got = await asyncio.to_thread(service.get, conv_id, request.page, _tenant(msg))
        await msg.send(encode_body(got))

    async def _delete(self, msg: Incoming) -> None:
        conv_id = read_checked(msg.data, ConversationRef).conversation_id
        await self._hold(conv_id, _tenant(msg))
        written = await self._call(self.service.delete, conv_id, _tenant(msg))
        await asyncio.wrap_future(written)
        if self.ownership is not None:
            await self.ownership.forget(conv_id)
        await msg.send(encode_body(DeleteReply(conv_id, True)))

    async def _create(self, msg: Incoming) -> None:
        body = read_checked(msg.data, CreateBody)
        messages = [{"role": turn.role, "content": turn.content} for turn in body.messages]
        conv_id, written = await self._call(self.service.create, messages, _tenant(msg))
        await asyncio.wrap_future(written)
        await msg.send(encode_body(CreateReply(conv_id)))

    async def _list(self, msg: Incoming) -> None:
        page = read_checked(msg.data, Page)
        listed = await asyncio.to_thread(self.service.list, page, _tenant(msg))
        await msg.send(encode_body(msgspec.structs.replace(listed, engine_id=self.engine_id)))

    async def _metrics(self, msg: Incoming) -> None:
        """The Prometheus text of this engine's metrics (`actors/scheduler/metrics.py`)."""
        await msg.send(self.service.metrics.exposition())

    async def _stats(self, msg: Incoming) -> None:
        # (the ingress checked that its body has no fields)
        # between two steps: fresh, at once; during one: the snapshot, whatever the step's length
        fresh = None if self.engine.stepping else self.engine.call(self.service.stats)
        try:
            if fresh is None:
                raise TimeoutError
            stats = await asyncio.wait_for(asyncio.wrap_future(fresh), STATS_WAIT_S)
            age = 0.0
        except TimeoutError:  # a step began meanwhile
            if fresh is not None:
                fresh.cancel()
            taken, stats = self.engine.snapshot
            age = time.monotonic() - taken
        # the engine thread's slowest step intervals, read here: a snapshot leaves them out
        stats = {**stats, "age_s": round(age, 3), "slow_steps": self.service.step_log.stats()}
        # objects frozen out of garbage collection (`pensieve serve` freezes its start-up heap)
        process = {"gc_frozen_objects": gc.get_freeze_count()}
        await msg.send(orjson.dumps({"engine_id": self.engine_id, **stats, "process": process}))


async def _render(bus: Bus, engine_id: str, reservation: Reservation, longest: int) -> list[int]:
    """The turn's prompt ids: its messages (and tools) through the chat template, then the
    reply's start, or a raw completion's text encoded as it is (both by a tokenizer replica),
    or the ids the client gave."""
    prompt = reservation.request.prompt
    if isinstance(prompt, tuple):
        return list(prompt)
    if prompt is not None:
        return await render_remote(bus, engine_id, [], RENDER_TIMEOUT_S, longest, prompt)
    return await render_remote(
        bus,
        engine_id,
        reservation.messages,
        RENDER_TIMEOUT_S,
        longest,
        tools=reservation.request.tools,
    )


def _tenant(msg: Incoming) -> str | None:
    """The tenant the ingress received the request from (None: the service's own account)."""
    return msg.headers.get(TENANT_HEADER)


LOOP_TICK_S = 0.01


@contextlib.asynccontextmanager
async def watching_loop(log: StepLog, tick_s: float = LOOP_TICK_S) -> AsyncIterator[None]:
    """While open: a task on the running loop that sleeps `tick_s` at a time and tells `log`
    how late it woke (`loop_stall`), so a stall of the loop that sends the replies shows."""

    async def watch() -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(tick_s)
            log.loop_stall(max(time.monotonic() - began - tick_s, 0.0))

    task = asyncio.create_task(watch(), name="pensieve-loop-watch")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
