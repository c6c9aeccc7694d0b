"""The store commit of a finished turn, and its reply once the commit is durable.

Finished turns are committed to the LMDB store by the store writer thread; the reply is sent
once the commit is durable. The conversation stays busy until then and moves on only with the
store: a failed commit leaves it as it was before the turn (its next turn recomputes from the
divergence), and a delete cannot slip in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from pensieve.actors.scheduler.conversations import prompt_sources, reply_message
from pensieve.actors.scheduler.metrics import Metrics
from pensieve.actors.scheduler.replication import Replicate, after_replicated
from pensieve.actors.scheduler.request import Request, common_prefix
from pensieve.actors.scheduler.turn import Turn
from pensieve.actors.wire.fencing import Fenced, LogUnavailable
from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.replies import chat_reply
from pensieve.actors.wire.schemas import ApiError
from pensieve.store import ConversationStore, Messages, StoreWriter, TurnRecord, turn_log

logger = logging.getLogger(__name__)


def turn_record(
    turn: int,
    user_message: str,
    text: str,
    request: Request,
    started_at: float,
    history: Messages | None = None,
    tool_results: tuple[dict[str, Any], ...] = (),
    tool_calls: tuple[dict[str, Any], ...] = (),
) -> TurnRecord:
    """The durable record of a finished turn (`history`: see `TurnRecord`; a reply that called
    tools ended "tool_calls")."""
    sources = request.sources
    reason = request.finish_reason.value if request.finish_reason else "abort"
    return TurnRecord(
        turn=turn,
        user_message=user_message,
        assistant_text=text,
        prompt_tokens=len(request.prompt_ids),
        new_prompt_tokens=sources.new,
        output_token_ids=tuple(request.output_ids),
        finish_reason="tool_calls" if tool_calls else reason,
        cached_gpu=sources.gpu,
        cached_cpu=sources.cpu,
        cached_recomputed=sources.recomputed,
        cached_disk=sources.disk,
        cached_shared=sources.shared,
        started_at=started_at,
        finished_at=max(time.time(), started_at),
        history=history,
        tool_results=tool_results,
        tool_calls=tool_calls,
    )


def last_sent(messages: Sequence[ChatMessage]) -> tuple[str, tuple[dict[str, Any], ...]]:
    """What a turn's chat ends with: the user's message ("" if it ends with a tool's) and the
    tool results ({"tool_call_id", "content"}) since the last reply."""
    last = messages[-1]
    user = last["content"] if last["role"] == "user" else ""
    sent = messages[:-1] if last["role"] == "user" else messages
    results: list[dict[str, Any]] = []
    for message in reversed(sent):
        if message["role"] != "tool":
            break
        results.insert(0, {"tool_call_id": message["tool_call_id"], "content": message["content"]})
    return user, tuple(results)


def commit_turn(
    store: ConversationStore,
    writer: StoreWriter,
    conv_id: str,
    record: TurnRecord,
    old_log: list[int],
    new_log: list[int],
    stateless: bool = False,
    final: bool = False,
    tenant: str | None = None,
) -> Future[Any]:
    """Hand the turn to the writer thread: the log keeps its common prefix with the new one."""
    keep = common_prefix(old_log, new_log)
    return writer.submit(
        store.commit_turn, conv_id, record, keep, new_log[keep:], stateless, final, tenant
    )


class TurnCommitter:
    """Commits finished turns (`submit`) and answers each once its commit settles
    (`answer_when_stored`); each turn is counted in `metrics` as its reply goes out. With
    `replicate`, a turn goes to the replicated turn log first, and to the store once the log
    has it."""

    def __init__(self, store: ConversationStore, writer: StoreWriter, metrics: Metrics) -> None:
        self.store = store
        self.writer = writer
        self.metrics = metrics
        self.replicate: Replicate | None = None

    def submit(self, turn: Turn, record: TurnRecord, log: list[int]) -> Future[Any]:
        """Hand the turn, whose token log is now `log`, to the log and the store writer."""
        conv = turn.conv
        keep = common_prefix(conv.log, log)

        def entry() -> bytes:
            return turn_log.committed(
                record, keep, log[keep:], conv.stateless, turn.final, conv.tenant
            )

        def write() -> Future[Any]:
            return commit_turn(
                self.store,
                self.writer,
                conv.conv_id,
                record,
                conv.log,
                log,
                conv.stateless,
                turn.final,
                conv.tenant,
            )

        return after_replicated(self.replicate, conv.conv_id, entry, write)

    def answer_when_stored(
        self, stored: Future[Any], turn: Turn, text: str, record: TurnRecord, log: list[int]
    ) -> None:
        """Once `stored` settles (on the store writer's thread): the conversation moves on and
        the reply goes out, or the turn fails and the conversation stays as before it."""
        conv, request = turn.conv, turn.request
        reply = chat_reply(
            conv.conv_id,
            record.turn,
            text,
            list(request.output_ids),
            record.finish_reason,
            record.prompt_tokens,
            prompt_sources(record),
            turn.final,
            record.tool_calls,
        )

        # `busy` is cleared last, so the engine thread, which reads it first, never sees half
        # an update.
        def answer(done: Future[Any]) -> None:
            error = done.exception()
            if error is None:
                conv.log = log
                conv.messages = [*turn.messages, reply_message(text, record.tool_calls)]
                conv.turns += 1
                conv.ended = turn.final
                conv.busy = False
                self.metrics.observe_turn(request)  # before the reply: a scrape after it sees it
                turn.sink.done(reply)
                _log_turn(conv.conv_id, record, request)
            else:
                conv.busy = False
                logger.error("turn %s of %s not stored: %s", record.turn, conv.conv_id, error)
                # fenced: another engine took the conversation meanwhile; sent again, the turn
                # goes to it (`turn` keeps a copy from being committed twice). The log did not
                # answer: sent again once it does, the turn is committed once.
                transient = isinstance(error, (Fenced, LogUnavailable))
                code = "unavailable" if transient else "internal"
                retry = "; retry" if transient else ""
                turn.sink.error(
                    ApiError(
                        code,
                        f"the turn could not be stored ({error}); the conversation is as "
                        f"before it{retry}",
                    )
                )

        stored.add_done_callback(answer)


def _log_turn(conv_id: str, record: TurnRecord, request: Request) -> None:
    """One line per finished turn: where its prompt came from, what it produced, how fast."""
    if not logger.isEnabledFor(logging.INFO):
        return
    first = request.first_token_time or request.arrival
    finish = request.finish_time or first
    logger.info(
        "turn %d of %s: %d prompt tokens (gpu %d, cpu %d, disk %d, recomputed %d, new %d; "
        "shared %d), "
        "%d completion tokens, %s; first token %.3f s, done %.3f s",
        record.turn,
        conv_id,
        record.prompt_tokens,
        record.cached_gpu,
        record.cached_cpu,
        record.cached_disk,
        record.cached_recomputed,
        record.new_prompt_tokens,
        record.cached_shared,
        len(record.output_token_ids),
        record.finish_reason,
        first - request.arrival,
        finish - request.arrival,
    )
