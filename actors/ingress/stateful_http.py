"""OpenAI's stateful APIs on the HTTP ingress: Responses and Conversations.

    POST   /v1/responses                        a turn (`actors/ingress/responses.py`)
    GET    /v1/responses/{id}                   a stored response
    DELETE /v1/responses/{id}                   the conversation that holds it
    GET    /v1/responses/{id}/input_items       what the response's turn added to the chat
    POST   /v1/conversations                    a conversation, with optional items
    GET    /v1/conversations/{id}               it
    DELETE /v1/conversations/{id}               it, with its responses
    GET    /v1/conversations/{id}/items         its chat, a page at a time

Each is one or more requests of the client API on the bus, sent as the tenant whose key came
with it (`HttpIngressActor.request`), so a tenant reaches only its own conversations, and
another's response or conversation is 404 as one that does not exist.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from pensieve.actors.ingress import conversation_items, response_tools, responses
from pensieve.actors.ingress.http_limits import read_body
from pensieve.actors.ingress.openai_api import OpenAIError, checked_body
from pensieve.actors.ingress.response_events import ResponseEvents
from pensieve.actors.ingress.responses import ResponseRef, ResponsesRequest
from pensieve.actors.wire import subjects
from pensieve.actors.wire.schemas import MAX_PAGE

if TYPE_CHECKING:
    from pensieve.actors.ingress.http_actor import Answer, HttpIngressActor

Message = dict[str, Any]
Plan = tuple[dict[str, Any], int]  # a chat request, and the number its turn will have
PLAN_TRIES = 3  # plans of a response's turn, each after another turn took the number planned


class StatefulRoutes:
    def __init__(self, actor: HttpIngressActor) -> None:
        self.actor = actor

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self._create)
        router.add_get("/v1/responses/{id}", self._retrieve)
        router.add_delete("/v1/responses/{id}", self._delete)
        router.add_get("/v1/responses/{id}/input_items", self._input_items)
        router.add_post("/v1/conversations", self._new_conversation)
        router.add_get("/v1/conversations/{id}", self._conversation)
        router.add_delete("/v1/conversations/{id}", self._delete_conversation)
        router.add_get("/v1/conversations/{id}/items", self._items)

    # ---- responses ----------------------------------------------------------------------------

    async def _create(self, request: web.Request) -> web.StreamResponse:
        actor = self.actor
        tenant = actor.tenant(request)
        body = await read_body(request, actor.config.read_timeout_s)
        asked = responses.to_request(body, actor.config.model)
        turn, first, answer = await self._start(asked, tenant)
        ref = ResponseRef(first["conversation_id"], turn)
        try:
            if asked.stream:
                return await self._stream(request, asked, ref, first, answer, tenant)
            reply = await actor.last(first, answer)
            ref = ResponseRef(reply["conversation_id"], reply["turn"])
            await self._unless_stored(asked, ref, tenant)
            return _json(self._finished(asked, ref, reply))
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            actor.abandon(answer, tenant)
            raise
        finally:
            if not answer.abandoned:
                await answer.close()

    async def _start(
        self, asked: ResponsesRequest, tenant: str | None
    ) -> tuple[int, dict[str, Any], Answer]:
        """Plan the response's turn and send it: the number it gets, its answer's first message
        and the answer. The turn says the number it was planned as; a conversation that took
        another turn since refuses it (`conflict`), and the turn is planned again on what the
        conversation holds now (a response to one no longer the latest branches)."""
        for tries_left in reversed(range(PLAN_TRIES)):
            chat, turn = await self._plan(asked, tenant)
            if "conversation_id" in chat:
                chat["turn"] = turn
            if not asked.store:
                chat["final"] = True  # its KV freed at once; the conversation goes after the reply
            try:
                first, answer = await self.actor.first({**chat, **asked.sampling}, tenant, False)
                return turn, first, answer
            except OpenAIError as refused:
                if refused.code != "conflict":
                    raise responses.in_request_terms(refused) from None
                if not tries_left:  # the field at fault is none of the request's
                    raise OpenAIError(409, refused.message, refused.kind, refused.code) from None
        raise AssertionError("unreachable: the last try returns or raises")

    async def _plan(self, asked: ResponsesRequest, tenant: str | None) -> Plan:
        """The chat request of the response's turn (see `responses.py`)."""
        if asked.conversation is not None:
            opening, turns = await self._turns(asked.conversation, tenant)
            so_far = responses.chat_until(opening, turns, len(turns) - 1)
            chat = responses.with_input(so_far, asked)
            return responses.next_turn(asked.conversation, so_far, chat), len(turns)
        context: list[Message] = []
        previous = asked.previous
        if previous is not None:
            num_turns = (await self._stored_turn(previous, tenant))[1]
            latest = asked.store and previous.turn == num_turns - 1
            alone = response_tools.sent_alone(asked.items)
            if latest and asked.instructions is None and alone is not None:  # no need of the chat
                return {"conversation_id": previous.conv_id, **alone}, num_turns
            opening, turns = await self._turns(previous.conv_id, tenant, previous.turn)
            context = responses.chat_until(opening, turns, previous.turn)
            if latest:
                chat = responses.with_input(context, asked)
                return responses.next_turn(previous.conv_id, context, chat), num_turns
        chat = responses.with_input(context, asked)  # a new conversation
        if len(chat) == 1:
            return {"message": chat[0]["content"]}, 0
        if not asked.store:
            return {"messages": chat}, 0
        sent = responses.last_sent(chat)  # made with the rest, then continued by these
        opening_body = {"messages": chat[: len(chat) - sent]}
        made = await self.actor.request(subjects.CONVERSATIONS_CREATE, opening_body, tenant)
        alone = response_tools.sent_alone(chat[len(chat) - sent :])
        return {"conversation_id": made["conversation_id"], **(alone or {})}, 0

    async def _stream(
        self,
        request: web.Request,
        asked: ResponsesRequest,
        ref: ResponseRef,
        first: dict[str, Any],
        answer: Answer,
        tenant: str | None,
    ) -> web.StreamResponse:
        opened = responses.response(ref, asked, asked.model, None)
        events = ResponseEvents(ref, opened)
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await stream.prepare(request)
        for event in events.opening():
            await stream.write(event)
        message = first
        try:
            while "delta" in message:
                for event in events.delta(message["delta"]) if message["delta"] else ():
                    await stream.write(event)
                message = await self.actor.next_message(answer)
            await self._unless_stored(asked, ref, tenant)
            for event in events.closing(self._finished(asked, ref, message)):
                await stream.write(event)
        except OpenAIError as error:
            await stream.write(events.error(error))
        await stream.write_eof()
        return stream

    def _finished(
        self, asked: ResponsesRequest, ref: ResponseRef, reply: dict[str, Any]
    ) -> dict[str, Any]:
        finished = {**reply, "usage": responses.usage(reply)}
        return responses.response(ref, asked, asked.model, finished)

    async def _unless_stored(
        self, asked: ResponsesRequest, ref: ResponseRef, tenant: str | None
    ) -> None:
        """`store: false`: the response's conversation is deleted before the reply is out."""
        if not asked.store:
            body = {"conversation_id": ref.conv_id}
            await self.actor.request(subjects.CONVERSATIONS_DELETE, body, tenant)

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        tenant = self.actor.tenant(request)
        ref = responses.parse_response_id(request.match_info["id"])
        turn, _ = await self._stored_turn(ref, tenant)
        return _json(responses.stored_response(ref, turn, self.actor.config.model))

    async def _delete(self, request: web.Request) -> web.StreamResponse:
        tenant = self.actor.tenant(request)
        ref = responses.parse_response_id(request.match_info["id"])
        await self._stored_turn(ref, tenant)
        body = {"conversation_id": ref.conv_id}
        await self.actor.request(subjects.CONVERSATIONS_DELETE, body, tenant)
        return _json({"id": ref.id, "object": "response", "deleted": True})

    async def _input_items(self, request: web.Request) -> web.StreamResponse:
        tenant = self.actor.tenant(request)
        ref = responses.parse_response_id(request.match_info["id"])
        await self._stored_turn(ref, tenant)
        opening, turns = await self._turns(ref.conv_id, tenant, ref.turn)
        prompt = responses.chat_until(opening, turns, ref.turn)[:-1]
        before = responses.chat_until(opening, turns, ref.turn - 1)
        added = prompt[len(before) :] if prompt[: len(before)] == before else prompt
        return _json(conversation_items.page(added, dict(request.query)))

    async def _stored_turn(
        self, ref: ResponseRef, tenant: str | None
    ) -> tuple[dict[str, Any], int]:
        """The stored turn a response id names, and how many turns its conversation has,
        counting one in progress (a response to the latest then branches); 404 if there is
        none the tenant reaches."""
        body = {"conversation_id": ref.conv_id, "cursor": str(ref.turn), "limit": 1}
        try:
            got = await self.actor.request(subjects.CONVERSATIONS_GET, body, tenant)
        except OpenAIError as error:
            if error.code in ("not_found", "invalid_request"):
                raise responses.not_found(ref.id) from None
            raise
        if not got["turns"] or got["turns"][0]["turn"] != ref.turn:
            raise responses.not_found(ref.id)
        return got["turns"][0], got["num_turns"] + int(got["busy"])

    async def _turns(
        self, conv_id: str, tenant: str | None, upto: int | None = None
    ) -> tuple[list[Message], list[dict[str, Any]]]:
        """The conversation's opening messages, and its turns up to `upto` (None: all)."""
        turns: list[dict[str, Any]] = []
        cursor = None
        while True:
            body = {"conversation_id": conv_id, "cursor": cursor, "limit": MAX_PAGE}
            got = await self.actor.request(subjects.CONVERSATIONS_GET, body, tenant)
            turns += got["turns"]
            cursor = got["next_cursor"]
            if cursor is None or (upto is not None and len(turns) > upto):
                return got["opening"], turns

    # ---- conversations ------------------------------------------------------------------------

    async def _new_conversation(self, request: web.Request) -> web.StreamResponse:
        actor = self.actor
        tenant = actor.tenant(request)
        data = await read_body(request, actor.config.read_timeout_s)
        body = checked_body(data, actor.config.model, {"metadata": (None, {})})
        items = responses.input_items(body.get("items"), "items")
        made = await actor.request(subjects.CONVERSATIONS_CREATE, {"messages": items}, tenant)
        return _json(conversation_items.conversation(made["conversation_id"], time.time()))

    async def _conversation(self, request: web.Request) -> web.StreamResponse:
        tenant = self.actor.tenant(request)
        conv_id = request.match_info["id"]
        body = {"conversation_id": conv_id, "limit": 1}
        got = await self.actor.request(subjects.CONVERSATIONS_GET, body, tenant)
        return _json(conversation_items.conversation(conv_id, got["created_at"]))

    async def _delete_conversation(self, request: web.Request) -> web.StreamResponse:
        tenant = self.actor.tenant(request)
        conv_id = request.match_info["id"]
        await self.actor.request(
            subjects.CONVERSATIONS_DELETE, {"conversation_id": conv_id}, tenant
        )
        return _json(conversation_items.deleted(conv_id))

    async def _items(self, request: web.Request) -> web.StreamResponse:
        tenant = self.actor.tenant(request)
        opening, turns = await self._turns(request.match_info["id"], tenant)
        chat = responses.chat_until(opening, turns, len(turns) - 1)
        return _json(conversation_items.page(chat, dict(request.query)))


def _json(body: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")
