"""The HTTP ingress actor: OpenAI's chat-completions API over HTTP, in front of the NATS one.

    POST /v1/chat/completions   whole or streamed (server-sent events) replies
    POST /v1/completions        the same for a raw prompt (no chat template; one turn)
    /v1/responses, /v1/conversations   OpenAI's stateful APIs (`actors/ingress/stateful_http.py`)
    GET  /v1/models             the model served
    GET  /health                200 while this engine's ingress and scheduler answer, else 503
    GET  /metrics               the scheduler's Prometheus metrics (`actors/scheduler/metrics.py`)
    GET  /version               this build's version, as vLLM answers it

Each completion becomes one `pensieve.v1.chat` request on the bus per choice of its `n`
(`actors/ingress/choices.py`; `actors/ingress/openai_api.py` translates both ways), sent with
the service's identity on the subject of the tenant whose API key came with it
(`pensieve.tenant.<tenant>.v1.chat`, where NATS delivers that tenant's own requests), so the
NATS ingress checks, scopes and forwards it as any other: tenancy stays a matter of NATS
subjects, and no tenant's key reaches another's conversations. The hop costs one
NATS message per turn; the streamed deltas come from the scheduler straight to this actor.

Every turn is streamed on the bus, a whole reply too (its deltas are read and dropped here):
the first delta names the turn's conversation, so a turn whose client goes away, streamed or
not, is cancelled at once (`pensieve.v1.chat.cancel`), its conversation kept as after any
cancel. What a client may hold of the server (time to send a request, connections) is bounded
in `actors/ingress/http_limits.py`.

The server is aiohttp: asyncio-native, so it shares the event loop and the bus connection of
the other actors of a process, starts and drains as an async context manager, streams responses
without a thread per request, and is one well-kept dependency with no server of its own to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from aiohttp import web
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from pensieve.actors.config import DEFAULTS
from pensieve.actors.ingress import openai_api, openai_replies
from pensieve.actors.ingress.chat_index import ChatIndex
from pensieve.actors.ingress.choices import Choices
from pensieve.actors.ingress.http_limits import CappedSite, read_body, server_options
from pensieve.actors.ingress.openai_api import CONVERSATION_HEADER, Completion, OpenAIError
from pensieve.actors.ingress.stateful_http import StatefulRoutes
from pensieve.actors.wire import subjects, tracing
from pensieve.actors.wire.actor import Actor
from pensieve.actors.wire.bus import Asked, Bus
from pensieve.actors.wire.schemas import ApiError
from pensieve.actors.wire.version import version

logger = logging.getLogger(__name__)

# an API key (None: none given) -> its tenant (None: the service's own); raises OpenAIError 401
Authenticate = Callable[[str | None], str | None]
Exposition = Callable[[], bytes]
HEALTH_TIMEOUT_S = 1.0
# a guessed conversation that is busy (invalid_request) or deleted (not_found): start a new one
_GUESS_MISSED = ("invalid_request", "not_found")
MAX_BODY_BYTES = 1 << 20  # NATS's default largest message


@dataclass(frozen=True)
class HttpConfig:
    port: int
    host: str = "127.0.0.1"
    model: str = "pensieve"  # the name clients give as `model`
    timeout_s: float = 600.0  # silence within an answer after which the request fails
    shutdown_grace_s: float = 20.0  # requests in flight get this long when it stops
    max_model_len: int | None = None  # the model's context, told by /v1/models (None: unknown)
    # a request's headers, then its body, must arrive within this; an idle connection closes
    read_timeout_s: float = DEFAULTS.http_read_timeout_s
    max_connections: int = DEFAULTS.http_max_connections  # one more is answered 503, closed

    def __post_init__(self) -> None:
        if not self.read_timeout_s > 0:
            raise ValueError(f"--http-read-timeout must be > 0, got {self.read_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"--http-max-connections must be >= 1, got {self.max_connections}")


class HttpIngressActor(Actor):
    name: ClassVar[str] = "http-ingress"
    description: ClassVar[str] = (
        "OpenAI-compatible HTTP API: /v1/chat/completions, /v1/responses, /metrics"
    )

    def __init__(
        self,
        bus: Bus,
        engine_id: str,
        config: HttpConfig,
        authenticate: Authenticate,
        metrics: Exposition | None = None,
    ) -> None:
        """`metrics`: the scheduler's metrics in this process (None: asked over the bus)."""
        super().__init__(bus, engine_id)
        self.config = config
        self.authenticate = authenticate
        self.metrics = metrics
        self.created = int(time.time())
        self.port: int | None = None  # the one bound (config.port 0: any free port)
        self.index = ChatIndex()  # the conversations stateless clients' chats continue
        self._runner: web.AppRunner | None = None
        self._abandoned: set[asyncio.Task[None]] = set()  # turns being cancelled

    async def setup(self) -> None:
        app = web.Application(middlewares=[_openai_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        StatefulRoutes(self).add_to(app.router)
        config = self.config
        self._runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=config.shutdown_grace_s,
            **server_options(config.read_timeout_s),
        )
        await self._runner.setup()
        await CappedSite(self._runner, config.host, config.port, config.max_connections).start()
        self.port = self._runner.addresses[0][1]

    async def teardown(self) -> None:
        if self._runner is not None:  # stops listening, then lets requests in flight finish
            await self._runner.cleanup()
        for task in self._abandoned:  # the bus goes next: their cancels cannot be sent
            task.cancel()
        await asyncio.gather(*self._abandoned, return_exceptions=True)

    def tenant(self, request: web.Request) -> str | None:
        """The tenant whose API key came with `request` (None: the service's own)."""
        return self.authenticate(openai_api.bearer_token(request.headers.get("Authorization")))

    async def request(self, subject: str, body: dict[str, Any], tenant: str | None) -> Any:
        """The answer of the client API on `subject` to `body`, asked as `tenant`; raises
        OpenAIError as a chat turn's answer does."""
        answer = Answer(self._asking(_as_tenant(tenant, subject), body))
        try:
            return await self.next_message(answer)
        finally:
            await answer.close()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        tenant = self.tenant(request)
        asked = openai_api.to_chat(
            await read_body(request, self.config.read_timeout_s),
            self.config.model,
            request.headers.get(CONVERSATION_HEADER),
        )
        return await self._answer(request, asked, tenant, "POST /v1/chat/completions")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        tenant = self.tenant(request)
        body = await read_body(request, self.config.read_timeout_s)
        asked = openai_api.to_text_completion(body, self.config.model)
        return await self._answer(request, asked, tenant, "POST /v1/completions")

    async def _answer(
        self, request: web.Request, asked: Completion, tenant: str | None, name: str
    ) -> web.StreamResponse:
        tracer = tracing.tracer("http-ingress")
        with tracer.start_as_current_span(name, kind=SpanKind.SERVER):
            choices = Choices(self, tenant)  # one turn per choice (`choices.py`)
            try:
                await choices.send(openai_api.choice_chats(asked))
                if not asked.stream:
                    replies = await choices.replies()
                    for reply in reversed(replies):  # a chat twice answered: choice 0's wins
                        self._remember(asked, tenant, reply)
                    body = openai_replies.completion(asked, replies)
                    return _json(body, replies[0]["conversation_id"])
                return await self._stream(request, asked, choices, tenant)
            except BaseException:  # a turn failed, or the client went away: the others end
                choices.cancel()
                raise
            finally:
                await choices.close()

    async def first(
        self, request: dict[str, Any], tenant: str | None, guess_chat: bool = True
    ) -> tuple[dict[str, Any], Answer]:
        """Send the chat request; its answer's first message, and the answer (to close). A
        stateless chat that continues a known conversation goes to it (`chat_index.py`,
        unless `guess_chat` is false); if that one is busy or gone, the chat starts a new
        conversation instead."""
        chat = {**request, "stream": True}  # see the module: the first delta names the turn
        guess = None
        if guess_chat and "messages" in chat and "conversation_id" not in chat:
            guess = self.index.find(tenant, chat["messages"])
        headers: dict[str, str] = {}
        propagate.inject(headers)  # the NATS ingress's span goes under this one
        tries = [{**chat, "conversation_id": guess}] if guess else []
        for body in [*tries, chat]:
            answer = Answer(self._asking(_as_tenant(tenant, subjects.CHAT), body, headers))
            try:
                return await self.next_message(answer), answer
            except asyncio.CancelledError:
                self.abandon(answer, tenant)
                raise
            except BaseException as error:
                await answer.close()
                guessed = body is not chat
                if not (guessed and isinstance(error, OpenAIError) and error.code in _GUESS_MISSED):
                    raise
        raise AssertionError("unreachable: the last try returns or raises")

    def _asking(
        self, subject: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> Callable[[], Awaitable[Asked]]:
        """What sends `body` on `subject` when an `Answer` first reads."""
        data = orjson.dumps(body)
        return lambda: self.bus.asking(subject, data, self.config.timeout_s, headers)

    async def last(self, first: dict[str, Any], answer: Answer) -> dict[str, Any]:
        """The whole reply: the answer's last message (its deltas dropped)."""
        message = first
        while "delta" in message:
            message = await self.next_message(answer)
        return message

    def _remember(self, asked: Completion, tenant: str | None, reply: dict[str, Any]) -> None:
        """A whole chat answered: the next request that continues it finds its conversation."""
        if "messages" in asked.chat:
            self.index.remember(
                tenant,
                asked.chat["messages"],
                openai_api.reply_message(reply),
                reply["conversation_id"],
            )

    async def _stream(
        self, request: web.Request, asked: Completion, choices: Choices, tenant: str | None
    ) -> web.StreamResponse:
        """Stream the replies from their first messages on, the choices' chunks interleaved as
        they come: whatever fails before them is answered with its status code, what fails
        after them as an error event (and the other choices' turns are cancelled)."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                CONVERSATION_HEADER: str(choices.firsts[0]["conversation_id"]),
            }
        )
        await response.prepare(request)
        for opening in openai_replies.first_chunks(asked):
            await response.write(openai_replies.event(opening))
        replies: dict[int, dict[str, Any]] = {}  # by choice
        try:
            given = list(enumerate(choices.firsts))  # then the next messages as they come
            while len(replies) < asked.n:
                # what came meanwhile goes out with it, in one write
                came = [given.pop(0) if given else await choices.next(), *choices.ready()]
                events: list[bytes] = []
                for index, message in came:
                    if "delta" in message:
                        delta = openai_replies.chunk(asked, message["delta"], index=index)
                        events.append(openai_replies.event(delta))
                        continue
                    replies[index] = message
                    self._remember(asked, tenant, message)
                    for last in openai_replies.last_chunks(asked, message, index):
                        events.append(openai_replies.event(last))
                await response.write(b"".join(events))
            if asked.include_usage:
                ordered = [replies[index] for index in range(asked.n)]
                await response.write(
                    openai_replies.event(openai_replies.usage_chunk(asked, ordered))
                )
        except OpenAIError as error:
            choices.cancel()
            await response.write(openai_replies.event(error.body()))
        await response.write(openai_replies.DONE)
        await response.write_eof()
        return response

    async def next_message(self, answer: Answer) -> dict[str, Any]:
        try:
            message = await answer.next()
        except TimeoutError:
            raise OpenAIError(
                504, f"no answer in {self.config.timeout_s:.0f} s", "server_error", "timeout"
            ) from None
        except (ConnectionError, StopAsyncIteration):
            raise OpenAIError(
                503,
                f"engine {self.engine_id} does not answer; retry when it does",
                "server_error",
                "unavailable",
            ) from None
        except ApiError as refused:  # a request the bus cannot carry (too large for NATS)
            raise openai_api.from_api_error(refused) from None
        if "error" in message:
            raise openai_api.from_reply_error(message)
        return message

    def abandon(self, answer: Answer, tenant: str | None) -> None:
        """The client went away: cancel its turn, once a message of the answer names it."""
        if not answer.abandoned and not answer.finished:
            answer.abandoned = True
            task = asyncio.ensure_future(self._cancel(answer, tenant))
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned.discard)

    async def _cancel(self, answer: Answer, tenant: str | None) -> None:
        try:
            conv_id = answer.conv_id
            if conv_id is None:  # a new conversation: its first delta names it
                with contextlib.suppress(Exception):
                    message = await answer.next()
                    conv_id = message.get("conversation_id") if "delta" in message else None
            if conv_id is not None:
                subject = _as_tenant(tenant, subjects.CHAT_CANCEL)
                body = orjson.dumps({"conversation_id": conv_id})
                with contextlib.suppress(Exception):  # best effort: it ends at its limit anyway
                    await self.bus.publish(subject, body)
                logger.debug("%s: its HTTP client went away; cancelled", conv_id)
        finally:
            await answer.close()

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self.tenant(request)
        return _json(openai_api.models(self.config.model, self.created, self.config.max_model_len))

    async def _version(self, request: web.Request) -> web.StreamResponse:
        return _json({"version": version()})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        scheduler = f"$SRV.PING.{subjects.actor_service('scheduler')}.{self.engine_id}"
        ingress = subjects.engine_ping(self.engine_id)
        up = await asyncio.gather(
            *(self.bus.answers(s, HEALTH_TIMEOUT_S) for s in (ingress, scheduler))
        )
        if not all(up):
            raise OpenAIError(
                503, f"engine {self.engine_id} is not answering", "server_error", "unavailable"
            )
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.metrics is not None:
            text = self.metrics()
        else:  # the scheduler runs in a process of its own
            subject = subjects.internal(self.engine_id, "scheduler", "metrics")
            try:
                async with aclosing(self.bus.ask(subject, b"", HEALTH_TIMEOUT_S * 5)) as answer:
                    text = await anext(answer)
            except (TimeoutError, ConnectionError):
                raise OpenAIError(
                    503,
                    f"the scheduler of engine {self.engine_id} does not answer",
                    "server_error",
                    "unavailable",
                ) from None
        return web.Response(body=text, headers={"Content-Type": subjects.METRICS_CONTENT_TYPE})


class Answer:
    """A turn's answer on the bus (`Bus.asking`), read so that a reader cancelled (its client
    gone) loses nothing: the request is sent once whatever befalls its sender, and its messages
    stay queued, for `HttpIngressActor._cancel`."""

    def __init__(self, ask: Callable[[], Awaitable[Asked]]) -> None:
        self._ask = ask
        self._sending: asyncio.Task[Asked] | None = None
        self._asked: Asked | None = None
        self._held: dict[str, Any] | None = None  # an error `ready` left for `next`
        self.conv_id: str | None = None  # once a message named it
        self.finished = False  # its last message read: the turn has ended
        self.abandoned = False  # its client went away: the cancelling task closes it

    async def next(self) -> dict[str, Any]:
        """The next message, decoded."""
        if self._held is not None:
            message, self._held = self._held, None
            return message
        if self._asked is None:
            if self._sending is None:
                self._sending = asyncio.ensure_future(self._ask())
            self._asked = await asyncio.shield(self._sending)  # cancelled: the send goes on
        asked: Asked = self._asked
        return self._decoded(await asked.next())

    def ready(self) -> list[dict[str, Any]]:
        """The messages already here, decoded, without waiting; up to an error, which `next`
        gives."""
        messages: list[dict[str, Any]] = []
        while self._asked is not None and self._held is None and not self.finished:
            data = self._asked.take()
            if data is None:
                break
            message = self._decoded(data)
            if "error" in message:
                self._held = message
            else:
                messages.append(message)
        return messages

    def _decoded(self, data: bytes) -> dict[str, Any]:
        message: dict[str, Any] = orjson.loads(data)
        named = message.get("conversation_id")
        self.conv_id = named if isinstance(named, str) else self.conv_id
        self.finished = "delta" not in message
        return message

    async def close(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None and not sending.done():
            sending.cancel()
            await asyncio.wait([sending])
        if sending is not None and not sending.cancelled() and sending.exception() is None:
            await sending.result().close()


@contextlib.asynccontextmanager
async def serve_metrics(host: str, port: int, exposition: Exposition) -> AsyncIterator[None]:
    """`GET /metrics` alone on `host:port`, while the context is open (`--metrics-port`)."""

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=exposition(), headers={"Content-Type": subjects.METRICS_CONTENT_TYPE}
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield
    finally:
        await runner.cleanup()


def _as_tenant(tenant: str | None, subject: str) -> str:
    """Where the service receives `tenant`'s requests on `subject` (None: its own)."""
    return subject if tenant is None else subjects.tenant_subject(tenant, subject)


def _json(body: dict[str, Any], conv_id: str | None = None) -> web.Response:
    headers = {} if conv_id is None else {CONVERSATION_HEADER: conv_id}
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error in OpenAI's shape, with its status code; a client gone, one line of log."""
    try:
        return await handler(request)
    except asyncio.CancelledError:
        gone = request.transport is None  # else the server is stopping
        logger.info("%s %s: %s", request.method, request.path, _ended(gone))
        raise
    except ConnectionError:  # a write found the client gone: nobody reads an answer
        logger.info("%s %s: %s", request.method, request.path, _ended(True))
        return web.Response(status=499)
    except OpenAIError as error:
        return web.Response(
            status=error.status, body=orjson.dumps(error.body()), content_type="application/json"
        )
    except web.HTTPException as error:  # no such route, wrong method, body too large
        if error.status < 400:
            raise
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        shaped = OpenAIError(error.status, error.reason, kind, None)
        return web.Response(
            status=error.status, body=orjson.dumps(shaped.body()), content_type="application/json"
        )
    except Exception as failure:  # a bug: answered, logged, and the server goes on
        logger.exception("%s %s failed", request.method, request.path)
        shaped = OpenAIError(
            500, f"{type(failure).__name__}: {failure}", "server_error", "internal"
        )
        return web.Response(
            status=500, body=orjson.dumps(shaped.body()), content_type="application/json"
        )


def _ended(client_gone: bool) -> str:
    return "the client went away" if client_gone else "cut short: the server is stopping"
