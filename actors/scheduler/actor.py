"""The async shell of the chat service: NATS subjects in, the engine on a thread of its own.

`EngineThread` owns the `ChatService` (and through it the engine, the scheduler and the cache):
every call into it runs on that thread, between steps (or, for the tokenizer's answers, while a
step waits for the device), so none of them needs a lock. The thread steps the engine while there
is work and otherwise sleeps on its command queue.

`ChatServer` is the scheduler actor's shell: it takes the client requests the ingress hands
over (`actors/ingress/`) on the scheduler's internal subjects, has the chat template rendered by
a tokenizer replica (`actors/tokenizer/actor.py`), hands the turn to the engine thread, and sends
replies (or streamed deltas) straight to the client's inbox.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import orjson
import torch
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from pensieve.actors.executor.model_runner import Launch
from pensieve.actors.planner.actor import plan_remote
from pensieve.actors.scheduler.chat_service import ChatService, Reservation
from pensieve.actors.scheduler.kv.kv_events import KvEventStream
from pensieve.actors.tokenizer.actor import RENDER_TIMEOUT_S, detokenize_remote, render_remote
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.bus import (
    REQUESTER_HEADER,
    TENANT_HEADER,
    Bus,
    Handler,
    Incoming,
    ServiceInfo,
)
from pensieve.actors.wire.messages import DetokenizeRequest, KvEvent, encode_kv_events
from pensieve.actors.wire.schemas import (
    ApiError,
    CancelReply,
    ChatDelta,
    ChatRequest,
    ConversationRef,
    DeleteReply,
    GetRequest,
    Page,
    encode_body,
    read_checked,
)
from pensieve.actors.wire.version import version

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_STOP = object()
SNAPSHOT_EVERY_S = 0.1
STATS_WAIT_S = 0.05  # how long a stats request waits for the engine thread, then its snapshot
# how long the engine thread takes answers during a step before it waits on the step itself,
# which checks that a remote executor still lives
TAKE_TEXT_FOR_S = 1.0
PROBE_EVERY_S = 0.5  # a streamed turn's deltas ask NATS whether its inbox is there this often


class _StepDone:
    """Queued when a remote step's tokens are in: the engine thread stops taking answers."""

    def __init__(self, step: Launch) -> None:
        self.step = step


class EngineThread:
    """The thread that steps the engine and runs the API calls queued to it.

    On a CPU engine its PyTorch work runs on `cpu_threads` threads (see `ops.factory.cpu_threads`:
    one core is left to the event loop, the tokenizer thread and NATS, because PyTorch's parallel
    regions wait for their slowest thread whenever those run)."""

    def __init__(self, service: ChatService, cpu_threads: int | None = None) -> None:
        self.service = service
        self.cpu_threads = cpu_threads
        # the service's stats as of a recent step, for a stats request that finds the thread
        # busy: it never waits for a step (refreshed at most every SNAPSHOT_EVERY_S)
        self.snapshot: tuple[float, dict[str, Any]] = (time.monotonic(), service.stats())
        self.stepping = False  # in a step now: a stats request takes the snapshot
        service.metrics.follow_engine(lambda: self.snapshot[1])  # read at each scrape
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._deferred: collections.deque[Any] = collections.deque()  # taken out during a step
        self._thread = threading.Thread(target=self._run, name="pensieve-engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)` on the engine thread, between two steps."""
        future: Future[_T] = Future()
        self._commands.put((fn, args, future, False))
        return future

    def call_text(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)`, which applies a tokenizer's answer, on the engine thread: between
        two steps, or as soon as it comes while a remote step is in flight (see
        `ChatService.take_text`)."""
        future: Future[_T] = Future()
        self._commands.put((fn, args, future, True))
        return future

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)  # this thread's parallel regions
        broken: ApiError | None = None  # set when a reset failed too: no more steps
        stepped = False  # since the snapshot
        while True:
            busy = broken is None and self.service.has_work()
            if stepped and not busy:  # idle from here: the snapshot is exact until it steps
                self.snapshot, stepped = (time.monotonic(), self.service.stats()), False
            try:
                command = self._deferred.popleft() if self._deferred else None
                command = command or self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            if isinstance(command, _StepDone):  # that wait ended already
                continue
            if command is _STOP:
                self.service.fail_all(ApiError("internal", "the server is shutting down"))
                return
            if command is not None:
                _run_command(command, broken)
                continue  # take every queued command before the next step
            try:
                self.stepping = True
                self.service.step()
                self.stepping = False
                stepped = True
                if time.monotonic() - self.snapshot[0] > SNAPSHOT_EVERY_S:
                    self.snapshot, stepped = (time.monotonic(), self.service.stats()), False
            except Exception as error:
                self.stepping = False
                logger.exception("engine step failed; resetting the engine")
                try:
                    self.service.recover(error)
                except Exception as failure:  # e.g. a device error that does not go away
                    logger.exception("the engine could not be reset; it takes no more turns")
                    broken = ApiError(
                        "internal",
                        f"the engine failed and could not be reset ({failure}); restart the server",
                    )
                    self.service.fail_all(broken)

    def take_text(self, step: Launch) -> None:
        """While `step` runs in a remote executor: apply the tokenizer's answers as they come
        (an answer only touches turns whose tokens it was asked about); keep every other
        command, in order, for after the step."""
        if not step.when_done(lambda: self._commands.put(_StepDone(step))):
            return
        while True:
            try:
                command = self._commands.get(timeout=TAKE_TEXT_FOR_S)
            except queue.Empty:
                return
            if isinstance(command, _StepDone):
                if command.step is step:
                    return
            elif command is not _STOP and command[3]:
                _run_command(command, None)
            else:
                self._deferred.append(command)
                if command is _STOP:
                    return


def _run_command(command: tuple[Any, ...], broken: ApiError | None) -> None:
    fn, args, future, _ = command
    if not future.set_running_or_notify_cancel():  # its caller went away
        return
    try:
        if broken is not None:
            raise broken
        future.set_result(fn(*args))
    except BaseException as error:  # handed to the caller, who answers with it
        future.set_exception(error)


class _Reply:
    """A turn's sink: forwards the engine thread's calls to the event loop as queue items."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.abandoned = False  # its requester went away (on the event loop's thread)

    def _put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))

    def delta(self, text: str) -> None:
        self._put("delta", text)

    def done(self, reply: dict[str, Any]) -> None:
        self._put("done", reply)

    def error(self, error: ApiError) -> None:
        self._put("error", error)


class ChatServer:
    """With `remote_text`, reply tokens go to the tokenizer actor for their text; otherwise the
    engine thread finds it with the same core (`ChatService.detokenize`).

    A turn whose requester goes away is cancelled (`ChatService.abandon`). A streamed turn's
    deltas carry a probe as their reply subject (`Bus.on_no_responders`), at most every
    PROBE_EVERY_S: once nobody listens on its inbox, NATS says so. A tenant's inbox lies in
    another account, where NATS says nothing of the kind; there, with `events` (a connection
    of the system account), the closing of the tenant's connection ends its turns, streamed
    or not. A turn of the service's own account that is not streamed has no probe (any
    message would be taken for its reply): its `timeout_s` bounds it."""

    def __init__(
        self,
        bus: Bus,
        engine: EngineThread,
        engine_id: str,
        remote_text: bool = True,
        events: Bus | None = None,
    ) -> None:
        self.bus = bus
        self.events = events
        self.remote_text = remote_text
        self.engine = engine
        self.engine_id = engine_id
        self._kv_stream = KvEventStream(engine_id)  # this process's KV event batches
        self._kv_sends: set[asyncio.Task[None]] = set()
        self._detokenizing: set[asyncio.Task[None]] = set()
        self._probes = ""  # the prefix of this connection's probe subjects
        self._num_probes = 0
        self._probed: dict[str, _Reply] = {}  # probe subject -> its turn's sink
        self._by_requester: dict[str, set[_Reply]] = {}  # tenant connection -> its turns

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests, give those in hand `grace_s` to finish, then answer what is
        left `unavailable`: every requester gets a final message, nobody waits out a timeout."""
        await self.bus.stop_serving()
        left = await self.bus.settle(grace_s)
        if left:
            logger.info(
                "%d requests still running after %.0f s; answering them unavailable", left, grace_s
            )
            closed = ApiError("unavailable", "the server is shutting down; send the turn again")
            with contextlib.suppress(ApiError):  # a broken engine answers every turn itself
                await self._call(self.engine.service.close, closed)
            await self.bus.settle(5.0)  # their error replies go out

    async def start(self) -> None:
        """Take the requests the ingress hands to this engine's scheduler (see
        `actors/ingress/actor.py`), each answered to its client directly."""
        await self._call(self._publish_kv_events, asyncio.get_running_loop())
        self._probes = await self.bus.on_no_responders(self._inbox_gone)
        if self.events is not None:
            await self.events.on_disconnects(self._requester_gone)
            await self.events.flush()
        if self.remote_text:
            await self._call(self._detokenize_remotely, asyncio.get_running_loop())
        handlers: dict[str, Handler] = {
            "chat": self._chat,
            "cancel": self._cancel,
            "get": self._get,
            "delete": self._delete,
            "list": self._list,
            "stats": self._stats,
        }
        for verb, handler in handlers.items():
            subject = subjects.internal(self.engine_id, "scheduler", verb)
            await self.bus.serve(subject, handler, queue="scheduler", handoff=True)
        # asked directly (not handed off) by an HTTP ingress in another process
        metrics = subjects.internal(self.engine_id, "scheduler", "metrics")
        await self.bus.serve(metrics, self._metrics, queue="scheduler")
        await self.bus.advertise(
            ServiceInfo(
                subjects.actor_service("scheduler"),
                self.engine_id,
                version(),
                "admission, the unified batch, KV accounting and eviction; plans every step",
            )
        )
        await self.bus.flush()  # started means subscribed: a request sent now is answered

    def _publish_kv_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: from now on each step's KV events go out on this engine's KV
        subject. A batch is numbered and encoded on the engine thread, in step order, and sent
        from the event loop."""

        def publish(events: list[KvEvent]) -> None:
            body = encode_kv_events(self._kv_stream.batch(events))
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to send to
                loop.call_soon_threadsafe(self._send_kv, body)

        self.engine.service.publish_kv = publish

    def _detokenize_remotely(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: from now on the reply tokens go to this engine's tokenizer
        replicas for their text, and each answer comes back to the engine thread."""

        def send(request: DetokenizeRequest) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to answer
                loop.call_soon_threadsafe(self._send_text, request)

        self.engine.service.detokenize = send
        self.engine.service.take_text = self.engine.take_text

    def _send_text(self, request: DetokenizeRequest) -> None:
        task = asyncio.ensure_future(self._detokenize(request))
        self._detokenizing.add(task)
        task.add_done_callback(self._detokenizing.discard)

    async def _detokenize(self, request: DetokenizeRequest) -> None:
        service = self.engine.service
        try:
            try:
                reply = await detokenize_remote(self.bus, self.engine_id, request, RENDER_TIMEOUT_S)
            except ApiError as error:
                await self._call(service.text_failed, request, error)
            else:
                await asyncio.wrap_future(self.engine.call_text(service.apply_text, reply))
        except ApiError as broken:  # the engine thread takes no more calls: it answered all
            logger.debug("a reply's text was not applied: %s", broken)

    def _send_kv(self, body: bytes) -> None:
        # tasks start in the order they are made, and each hands its message to the client
        # before it first waits, so batches leave in sequence
        task = asyncio.ensure_future(self._publish_kv(body))
        self._kv_sends.add(task)
        task.add_done_callback(self._kv_sends.discard)

    async def _publish_kv(self, body: bytes) -> None:
        try:
            await self.bus.publish(subjects.kv_events(self.engine_id), body)
        except Exception as error:  # shutting down: subscribers see the gap in seq
            logger.debug("a KV event batch was not sent: %s", error)

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
        sink = _Reply(asyncio.get_running_loop())
        # a tenant's inbox is in another account, where a probe tells nothing (see the class)
        probing = _tenant(msg) is None
        with self._watching(sink, msg.headers.get(REQUESTER_HEADER), probing) as probe:
            await self._run_turn(msg, span, sink, probe)

    async def _run_turn(self, msg: Incoming, span: trace.Span, sink: _Reply, probe: str) -> None:
        request = read_checked(msg.data, ChatRequest)  # checked by the ingress
        service = self.engine.service
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
            kind, value = await sink.items.get()
            if kind == "delta":
                if not request.stream:
                    continue
                now = time.monotonic()
                asking = probe if now - probed_at >= PROBE_EVERY_S else ""
                probed_at = now if asking else probed_at
                # with the id: a new conversation's turn can be cancelled
                delta = encode_body(ChatDelta(value, conv_id))
                await msg.send(delta, probe=asking)
            elif kind == "error":
                raise value
            else:
                await msg.send(orjson.dumps({**value, "done": True} if request.stream else value))
                return

    @contextlib.contextmanager
    def _watching(self, sink: _Reply, requester: str | None, probing: bool) -> Iterator[str]:
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

    def _abandon(self, sink: _Reply) -> None:
        """Cancel the turn answering to `sink`; one not started yet is, once it starts."""
        sink.abandoned = True
        self.engine.call(self.engine.service.abandon, sink)

    async def _cancel(self, msg: Incoming) -> None:
        conv_id = read_checked(msg.data, ConversationRef).conversation_id
        cancelled = await self._call(self.engine.service.cancel, conv_id, _tenant(msg))
        await msg.send(encode_body(CancelReply(conv_id, cancelled)))

    async def _get(self, msg: Incoming) -> None:
        request = read_checked(msg.data, GetRequest)
        service, conv_id = self.engine.service, request.conversation_id
        # off the engine thread: a read never waits for a step to end
        got = await asyncio.to_thread(service.get, conv_id, request.page, _tenant(msg))
        await msg.send(orjson.dumps(got))

    async def _delete(self, msg: Incoming) -> None:
        conv_id = read_checked(msg.data, ConversationRef).conversation_id
        written = await self._call(self.engine.service.delete, conv_id, _tenant(msg))
        await asyncio.wrap_future(written)
        await msg.send(encode_body(DeleteReply(conv_id, True)))

    async def _list(self, msg: Incoming) -> None:
        page = read_checked(msg.data, Page)
        listed = await asyncio.to_thread(self.engine.service.list, page, _tenant(msg))
        await msg.send(orjson.dumps({**listed, "engine_id": self.engine_id}))

    async def _metrics(self, msg: Incoming) -> None:
        """The Prometheus text of this engine's metrics (`actors/scheduler/metrics.py`)."""
        await msg.send(self.engine.service.metrics.exposition())

    async def _stats(self, msg: Incoming) -> None:
        # (the ingress checked that its body has no fields)
        # between two steps: fresh, at once; during one: the snapshot, whatever the step's length
        fresh = None if self.engine.stepping else self.engine.call(self.engine.service.stats)
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
        stats = {**stats, "age_s": round(age, 3)}
        # objects frozen out of garbage collection (`pensieve serve` freezes its start-up heap)
        process = {"gc_frozen_objects": gc.get_freeze_count()}
        await msg.send(orjson.dumps({"engine_id": self.engine_id, **stats, "process": process}))


async def _render(bus: Bus, engine_id: str, reservation: Reservation, longest: int) -> list[int]:
    """The turn's prompt ids: its messages through the chat template, or a raw completion's
    text encoded as it is (both by a tokenizer replica), or the ids the client gave."""
    prompt = reservation.request.prompt
    if isinstance(prompt, tuple):
        return list(prompt)
    if prompt is not None:
        return await render_remote(bus, engine_id, [], RENDER_TIMEOUT_S, longest, prompt)
    return await render_remote(bus, engine_id, reservation.messages, RENDER_TIMEOUT_S, longest)


def _tenant(msg: Incoming) -> str | None:
    """The tenant the ingress received the request from (None: the service's own account)."""
    return msg.headers.get(TENANT_HEADER)
