"""The tokenizer actor: chat templates rendered into prompt token ids, and reply tokens turned
back into text with their stop strings found, by a queue group of stateless replicas.

Subjects `pensieve.internal.<engine>.tokenizer.render` (a `RenderRequest` in, a `RenderReply` or
an error back) and `...tokenizer.detokenize` (a `DetokenizeRequest` of one step's reply tokens
in, a `DetokenizeReply` back), queue group `tokenizer`. NATS hands each request to one replica,
so N replicas work on N requests at once, and one that dies loses only the requests it held,
which `render_remote` and `detokenize_remote` send again. A replica keeps nothing between
requests: each piece of reply tokens says where the last answer left off (`TextPiece`). Each
replica works on a worker thread of its own with a tokenizer of its own (a Rust tokenizer refuses
to be borrowed by two threads at once), so the event loop never waits on a template or a decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import orjson
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.tokenizer.chat_tokenizer import ChatMessage, ChatTokenizer
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Bus, ConnectOptions, Incoming
from pensieve.actors.wire.messages import (
    DetokenizeReply,
    DetokenizeRequest,
    MessageError,
    RenderReply,
    RenderRequest,
    TextPiece,
    TextUpdate,
    decode,
)
from pensieve.actors.wire.schemas import ERROR_CODES, ApiError

RENDER = "render"
DETOKENIZE = "detokenize"
RENDER_TIMEOUT_S = 30.0  # what the ingress gives one render, retries included
# a request left unanswered this many times is given up: each waits a share of the time left
MAX_SILENT_TRIES = 3
_FIRST_PAUSE_S = 0.05  # after "no responders": doubled each time, at most _MAX_PAUSE_S
_MAX_PAUSE_S = 1.0


class TokenizerActor(Actor):
    name = "tokenizer"
    description = (
        "renders chat templates into prompt token ids and finds the text and stop "
        "strings of reply tokens (one of N stateless replicas)"
    )

    def __init__(self, bus: Bus, engine_id: str, chat: ChatTokenizer) -> None:
        super().__init__(bus, engine_id)
        # renders and reply text on threads (and tokenizers) of their own: a turn's render
        # never waits behind a step's text
        self.chat = ChatTokenizer(copy.deepcopy(chat.tokenizer), chat.vocab_size)
        self._text_chat = ChatTokenizer(copy.deepcopy(chat.tokenizer), chat.vocab_size)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pensieve-tokenizer")
        self._text_worker = ThreadPoolExecutor(1, thread_name_prefix="pensieve-detokenizer")

    async def setup(self) -> None:
        await self.serve(RENDER, self._render)
        await self.serve(DETOKENIZE, self._detokenize)

    async def teardown(self) -> None:
        # a render still on the thread finishes there; nobody waits for its answer
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._text_worker.shutdown(wait=False, cancel_futures=True)

    async def _render(self, msg: Incoming) -> None:
        parent = propagate.extract(msg.headers)
        tracer = tracing.tracer(self.name)  # under the service pensieve-tokenizer
        with tracer.start_as_current_span(
            "tokenizer.render", context=parent, kind=SpanKind.SERVER, record_exception=False
        ) as span:
            try:
                ids = await self._render_ids(msg.data)
            except ApiError as error:
                tracing.record_refusal(span, error)
                raise
            span.set_attribute("pensieve.prompt_tokens", len(ids))
            await msg.send(RenderReply(ids).encode())

    async def _detokenize(self, msg: Incoming) -> None:
        loop = asyncio.get_running_loop()
        # decoded, followed and encoded on the text thread: the event loop only passes bytes
        answer = await loop.run_in_executor(self._text_worker, self._answer_text, msg.data)
        await msg.send(answer)

    def _answer_text(self, data: bytes) -> bytes:
        try:
            request = DetokenizeRequest.decode(data)
        except MessageError as error:
            raise ApiError("invalid_request", str(error)) from None
        return DetokenizeReply(self._follow(request.pieces)).encode()

    def _follow(self, pieces: Sequence[TextPiece]) -> tuple[TextUpdate, ...]:
        """A final piece is traced in its turn's trace."""
        tracer = tracing.tracer(self.name)
        updates = []
        for piece in pieces:
            if not piece.trace:
                updates.append(self._text_chat.follow(piece))
                continue
            parent = tracing.parent_context(piece.trace)
            with tracer.start_as_current_span("tokenizer.detokenize", context=parent) as span:
                update = self._text_chat.follow(piece)
                span.set_attributes(
                    {
                        "pensieve.completion_tokens": len(piece.ids),
                        "pensieve.stopped": update.stop_at is not None,
                    }
                )
            updates.append(update)
        return tuple(updates)

    async def _render_ids(self, data: bytes) -> list[int]:
        try:
            request = decode(data, RenderRequest)
        except MessageError as error:
            raise ApiError("invalid_request", str(error)) from None
        loop = asyncio.get_running_loop()
        if request.prompt is not None:  # a raw completion: no template
            render, given = self.chat.encode_prompt, request.prompt
        else:
            render, given = self.chat.render, request.messages
        try:
            ids = await loop.run_in_executor(self._worker, render, given)
        except Exception as error:  # the template's own checks (role order, ...)
            raise ApiError(
                "invalid_request",
                f"the chat template refused the messages: {type(error).__name__}: {error}",
            ) from None
        if request.max_tokens is not None and len(ids) > request.max_tokens:
            raise ApiError(
                "too_long",
                f"the prompt has {len(ids)} tokens; the model's context "
                f"holds {request.max_tokens + 1}",
            )
        # every id as decimal text with a separator: an upper bound on the answer's size
        if len(ids) * 8 + 64 > self.bus.client.max_payload:
            raise ApiError(
                "too_long",
                f"the prompt has {len(ids)} tokens, more than one NATS "
                f"message of {self.bus.client.max_payload} bytes carries",
            )
        return ids


@contextlib.asynccontextmanager
async def tokenizer_replicas(
    url: str,
    engine_id: str,
    chat: ChatTokenizer,
    num_replicas: int,
    connect: ConnectOptions | None = None,
) -> AsyncIterator[list[TokenizerActor]]:
    """`num_replicas` tokenizer actors of engine `engine_id`, each on a NATS connection of its
    own: subscribed when the context is entered, stopped (their renders in hand finished) when
    it is left."""
    async with contextlib.AsyncExitStack() as stack:
        replicas = []
        for _ in range(num_replicas):
            bus = await Bus.connect(url, name="pensieve-tokenizer", options=connect)
            replica = TokenizerActor(bus, engine_id, chat)
            stack.push_async_callback(replica.stop)
            await replica.start()
            replicas.append(replica)
        yield replicas


async def render_remote(
    bus: Bus,
    engine_id: str,
    messages: Sequence[ChatMessage],
    timeout: float,
    max_tokens: int | None = None,
    prompt: str | None = None,
) -> list[int]:
    """The prompt token ids of `messages` (or of a raw `prompt`, encoded as it is, given with
    no messages), rendered by one of engine `engine_id`'s tokenizer replicas, in the caller's
    trace (resent as `_ask_replica` says). A template that refuses the messages:
    ApiError("invalid_request"); a prompt over `max_tokens`: ApiError("too_long")."""
    body = RenderRequest(tuple(messages), max_tokens, prompt).encode()
    answer = await _ask_replica(bus, engine_id, RENDER, body, timeout)
    try:
        return decode(answer, RenderReply).token_ids
    except MessageError as unreadable:  # an error body has no version: is it one?
        raise _refusal(answer) or ApiError(
            "internal", f"the tokenizer's answer could not be read: {unreadable}"
        ) from None


async def detokenize_remote(
    bus: Bus, engine_id: str, request: DetokenizeRequest, timeout: float
) -> DetokenizeReply:
    """The text of one step's reply tokens, found by one of engine `engine_id`'s tokenizer
    replicas (resent as `_ask_replica` says)."""
    answer = await _ask_replica(bus, engine_id, DETOKENIZE, request.encode(), timeout)
    try:
        reply = DetokenizeReply.decode(answer)
    except MessageError as unreadable:
        raise _refusal(answer) or ApiError(
            "internal", f"the tokenizer's answer could not be read: {unreadable}"
        ) from None
    if [u.key for u in reply.updates] != [p.key for p in request.pieces]:
        raise ApiError("internal", "the tokenizer answered other pieces than those asked")
    return reply


async def _ask_replica(bus: Bus, engine_id: str, verb: str, body: bytes, timeout: float) -> bytes:
    """The answer of one of the engine's tokenizer replicas to `body` on `verb`, in the
    caller's trace.

    A request nobody answers is sent again, to whichever replica NATS picks then: one that went
    unanswered (its replica died or hangs holding it) up to `MAX_SILENT_TRIES` times, one that
    found no replica subscribed (all restarting, or reconnecting to NATS) after a short pause.
    After `timeout` s in all: ApiError("unavailable")."""
    subject = subjects.internal(engine_id, TokenizerActor.name, verb)
    headers: dict[str, str] = {}
    propagate.inject(headers)  # W3C traceparent: the replica's span is the caller's child
    deadline = time.monotonic() + timeout
    num_silent, pause = 0, _FIRST_PAUSE_S
    while (left := deadline - time.monotonic()) > 0 and num_silent < MAX_SILENT_TRIES:
        try:
            return await _ask(bus, subject, body, left / (MAX_SILENT_TRIES - num_silent), headers)
        except TimeoutError:
            num_silent += 1
        except ConnectionError:
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, _MAX_PAUSE_S)
    raise ApiError(
        "unavailable",
        f"no tokenizer of engine {engine_id} answered {verb} in "
        f"{timeout:.0f} s; send the turn again",
    )


async def _ask(
    bus: Bus, subject: str, body: bytes, timeout: float, headers: dict[str, str]
) -> bytes:
    """One try: the first message of the answer (a render is answered in one)."""
    async with contextlib.aclosing(bus.ask(subject, body, timeout, headers)) as answer:
        return await anext(answer)


def _refusal(answer: bytes) -> ApiError | None:
    """The error a replica answered with, if `answer` is an error body."""
    with contextlib.suppress(orjson.JSONDecodeError):
        body = orjson.loads(answer)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("code") in ERROR_CODES:
            return ApiError(error["code"], str(error.get("message", "")))
    return None
