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
import functools
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer, ToolsUnsupported
from pensieve.actors.wire import tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Bus, ConnectOptions
from pensieve.actors.wire.calls import DETOKENIZE, RENDER, TOKENIZER
from pensieve.actors.wire.incoming import Incoming
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
from pensieve.actors.wire.schemas import ApiError


class TokenizerActor(Actor):
    name = TOKENIZER
    description = (
        "renders chat templates into prompt token ids and finds the text and stop "
        "strings of reply tokens (one of N stateless replicas)"
    )

    def __init__(self, bus: Bus, engine_id: str, chat: ChatTokenizer) -> None:
        super().__init__(bus, engine_id)
        # renders and reply text on threads (and tokenizers) of their own: a turn's render
        # never waits behind a step's text
        self.chat = ChatTokenizer(
            copy.deepcopy(chat.tokenizer), chat.vocab_size, chat.tool_parser_name
        )
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
            render = functools.partial(self.chat.encode_prompt, request.prompt)
        else:
            render = functools.partial(
                self.chat.render, request.messages, True, request.tools, request.prefill
            )
        try:
            ids = await loop.run_in_executor(self._worker, render)
        except ToolsUnsupported as error:
            raise ApiError("invalid_request", str(error)) from None
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
        if len(ids) * 8 + 64 > self.bus.max_payload:
            raise ApiError(
                "too_long",
                f"the prompt has {len(ids)} tokens, more than one NATS "
                f"message of {self.bus.max_payload} bytes carries",
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
