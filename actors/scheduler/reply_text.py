"""The text of the replies in flight: incremental detokenizing and stop strings (no I/O).

Reply tokens go to the tokenizer actor for their text (`detokenize`, set by the NATS shell; its
answers come back through `apply`); without one, the same core answers on this thread. A
followed turn (streamed, or with stop strings) has its text found as its tokens come; any other
turn once the engine is done with it. A turn has at most one piece out at a time, so answers
apply in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from pensieve.actors.scheduler.turn import Turn
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire import tracing
from pensieve.actors.wire.messages import DetokenizeReply, DetokenizeRequest, TextPiece
from pensieve.actors.wire.step import Launch

logger = logging.getLogger(__name__)


class ReplyText:
    """Finds the text of the turns in flight (`turns`, request id -> turn, read live). A stop
    string found at output token n calls `stop_at(turn, n)`; a turn whose final text has come
    calls `complete(turn)`."""

    def __init__(
        self,
        chat: ChatTokenizer,
        turns: Mapping[str, Turn],
        stop_at: Callable[[Turn, int], None],
        complete: Callable[[Turn], None],
    ) -> None:
        self.chat = chat
        self.turns = turns
        self.stop_at = stop_at
        self.complete = complete
        self.detokenize: Callable[[DetokenizeRequest], None] = self._detokenize_here
        # while the engine waits for the device, the tokenizer's answers (the NATS shell sets
        # this: it applies them as they come, so a reply's text never waits for the step after
        # the one in flight)
        self.take_text: Callable[[Launch], None] | None = None
        self._answers: list[DetokenizeReply] = []  # answered here, not applied yet
        self._applying = False
        self._followed: dict[str, Turn] = {}  # request id -> a followed turn still running
        # followed turns with new tokens, whose text is found here during the engine's next
        # wait for the device rather than between two steps, where it would delay the next one
        self._due: list[Turn] = []

    def follow(self, turn: Turn) -> None:
        """Find the turn's text as its tokens come."""
        self._followed[turn.request.request_id] = turn

    def unfollow(self, request_id: str) -> None:
        self._followed.pop(request_id, None)

    def clear(self) -> None:
        """Every turn in flight was answered otherwise."""
        self._followed.clear()
        self._due.clear()

    def grown(self, request_ids: Iterable[str]) -> list[Turn]:
        """Of the turns with new tokens (`request_ids`), the followed ones to ask about now. A
        tokenizer actor works on them meanwhile; found here, a reply's first text is asked at
        once (it is the time to first token) and later text during the next wait."""
        if not self._followed:
            return []
        grown = [self._followed[r] for r in request_ids if r in self._followed]
        if self.detokenize != self._detokenize_here:
            return grown
        asked: list[Turn] = []
        for turn in grown:
            (self._due if turn.fed else asked).append(turn)
        return asked

    @property
    def has_due(self) -> bool:
        return bool(self._due)

    def follow_due(self) -> None:
        due, self._due = self._due, []
        if due:
            self.ask(due)

    def while_waiting(self, step: Launch) -> None:
        """The engine waits for the device to finish `step`: find text meanwhile."""
        self.follow_due()
        if self.take_text is not None and any(turn.asking for turn in self.turns.values()):
            self.take_text(step)

    def apply(self, reply: DetokenizeReply) -> None:
        """The tokenizer's answer to pieces of replies (`detokenize`): stream what is safe to
        show, end a turn where a stop string completes (`stop_at`: the tokens sampled after it
        are discarded, so the reply never depends on how late the answer came), and complete a
        turn whose final text has come."""
        asked = []
        for update in reply.updates:
            turn = self.turns.get(update.key)
            if turn is None:  # answered meanwhile (failed, or the service closed)
                continue
            turn.asking = False
            turn.text = turn.text[: len(turn.text) - update.trim] + update.text
            turn.prefix, turn.read = update.prefix, update.read
            if update.stop_at is not None:
                self._followed.pop(update.key, None)  # nothing after the stop is followed
                self.stop_at(turn, update.stop_at)
            if update.whole is not None:
                turn.whole = update.whole
                self.complete(turn)
                continue
            if turn.stream and turn.request.stop_at is None:
                end = min(len(turn.text) - turn.holdback, _before_calls(turn))
                if end > turn.sent:
                    turn.sink.delta(turn.text[turn.sent : end], update.read)
                    turn.sent = end
            asked.append(turn)
        self.ask(asked)

    def ask(self, turns: Sequence[Turn]) -> None:
        """Send the tokenizer what `turns` have new: tokens of a followed turn, or the whole
        reply of one that ended."""
        pieces = [piece for turn in turns if (piece := self._piece(turn)) is not None]
        if pieces:
            self.detokenize(DetokenizeRequest(tuple(pieces)))
        if self._applying:  # answered here: the outermost call applies them, in order
            return
        self._applying = True
        try:
            while self._answers:
                self.apply(self._answers.pop(0))
        finally:
            self._applying = False

    def finish(self, turn: Turn) -> str:
        """The reply's final text (it has come), without the tool calls read from it (into
        `turn.tool_calls`); a streamed reply's last delta goes out."""
        assert turn.whole is not None
        text = turn.whole if turn.tool_parser is None else _read_calls(turn, turn.whole)
        if turn.stream:
            streamed = turn.text[: turn.sent]
            if not text.startswith(streamed):  # the tokenizer decodes a whole reply differently
                logger.warning(
                    "turn %s of %s: the reply's text does not continue its streamed deltas",
                    turn.conv.turns,
                    turn.conv.conv_id,
                )
            elif len(text) > turn.sent:
                turn.sink.delta(text[turn.sent :], len(turn.request.output_ids))
        return text

    def _detokenize_here(self, request: DetokenizeRequest) -> None:
        """Without a tokenizer actor (the service driven directly): the same core, here."""
        self._answers.append(DetokenizeReply(tuple(map(self.chat.follow, request.pieces))))

    def _piece(self, turn: Turn) -> TextPiece | None:
        if turn.asking or turn.whole is not None:
            return None
        output = turn.request.output_ids
        tail = turn.text[len(turn.text) - turn.holdback :] if turn.holdback else ""
        key = turn.request.request_id
        if turn.ended:
            prefix, read = (turn.prefix, turn.read) if turn.followed else (len(output),) * 2
            piece = TextPiece(
                key,
                tuple(output),
                0,
                prefix,
                read,
                tail,
                turn.stop,
                True,
                tracing.traceparent(turn.span),
            )
        elif turn.request.stop_at is None and len(output) > turn.fed:
            piece = TextPiece(
                key,
                tuple(output[turn.prefix :]),
                turn.prefix,
                turn.prefix,
                turn.read,
                tail,
                turn.stop,
            )
        else:
            return None
        turn.fed, turn.asking = len(output), True
        return piece


def _before_calls(turn: Turn) -> int:
    """How much of a streamed reply's text may go out: a reply read for tool calls streams
    its text up to where a call begins, and keeps back what may be a call's first characters."""
    parser = turn.tool_parser
    if parser is None:
        return len(turn.text)
    start = parser.start(turn.text)
    if start is not None:
        return start
    return len(turn.text) - parser.held(turn.text)


def _read_calls(turn: Turn, text: str) -> str:
    """The reply's content: its text before the tool calls read from it (the whole text, and
    no calls, when it makes none or a malformed one)."""
    parser = turn.tool_parser
    assert parser is not None
    parsed = parser.parse(text)
    if parsed is None:
        return text
    turn.tool_calls = parsed.calls
    return parsed.content
