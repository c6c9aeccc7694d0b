"""The turns that answer one HTTP completion: one per choice of its `n` (one for `n` = 1).

All of them are sent at once. Waiting for the first choice's prompt to be computed would not
let the others share its KV: a chunk becomes shareable by content when it is sealed, which is
when its turn ends (`actors/scheduler/kv/sharing.py`), so each choice computes the prompt, and
the copies merge into one as the turns end. Choice 0 alone may continue the conversation the
chat index finds; the others start conversations of their own, so each choice leaves one.

Their messages are read as they come, interleaved (`next`); if one turn fails, or the client
goes away, every turn not yet ended is cancelled (`cancel`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pensieve.actors.ingress.http_actor import Answer, HttpIngressActor

Message = dict[str, Any]


class Choices:
    def __init__(self, actor: HttpIngressActor, tenant: str | None) -> None:
        self.actor = actor
        self.tenant = tenant
        self.firsts: list[Message] = []  # each turn's first message, by choice
        self.answers: list[Answer] = []  # by choice
        self._reads: dict[int, asyncio.Task[Message]] = {}  # a choice's next message

    async def send(self, chats: list[Message]) -> None:
        """Send one turn per chat request, and wait for each turn's first message. If one
        fails, the others are cancelled and its error raised."""
        sends = [
            asyncio.ensure_future(self.actor.first(chat, self.tenant, guess_chat=index == 0))
            for index, chat in enumerate(chats)
        ]
        try:
            await asyncio.wait(sends, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # one failed, or the client went away: the turns not yet answered stop
            for send in sends:
                send.cancel()  # `first` cancels its turn itself
            await asyncio.wait(sends)
            sent = [send.result() for send in sends if _succeeded(send)]
            self.firsts = [first for first, _ in sent]
            self.answers = [answer for _, answer in sent]
        for send in sends:
            failure = None if send.cancelled() else send.exception()
            if failure is not None:
                self.cancel()
                raise failure

    async def next(self) -> tuple[int, Message]:
        """The next message of any turn not yet ended, as they come: its choice's index and
        the message. Raises `OpenAIError` as the turn's answer does."""
        if len(self.answers) == 1:  # no other turn to wait on
            return 0, await self.actor.next_message(self.answers[0])
        for index, answer in enumerate(self.answers):
            if not answer.finished and index not in self._reads:
                self._reads[index] = asyncio.ensure_future(self.actor.next_message(answer))
        done, _ = await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
        index = min(i for i, read in self._reads.items() if read in done)
        return index, self._reads.pop(index).result()

    def ready(self) -> list[tuple[int, Message]]:
        """The messages already here, without waiting, of a single turn (several turns'
        messages come one at a time from `next`)."""
        if len(self.answers) != 1:
            return []
        return [(0, message) for message in self.answers[0].ready()]

    async def replies(self) -> list[Message]:
        """Every choice's whole reply: its turn's last message (the deltas dropped)."""
        replies: list[Message | None] = [None if "delta" in m else m for m in self.firsts]
        while any(reply is None for reply in replies):
            index, message = await self.next()
            if "delta" not in message:
                replies[index] = message
        return [reply for reply in replies if reply is not None]

    def cancel(self) -> None:
        """Cancel every turn not yet ended (`HttpIngressActor.abandon`)."""
        for answer in self.answers:
            self.actor.abandon(answer, self.tenant)

    async def close(self) -> None:
        """Stop reading; a turn being cancelled is closed by the task that cancels it."""
        reads, self._reads = list(self._reads.values()), {}
        for read in reads:  # a read of a cancelled turn's answer goes on for its canceller
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        for answer in self.answers:
            if not answer.abandoned:
                await answer.close()


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return not task.cancelled() and task.exception() is None
