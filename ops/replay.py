"""`pensieve replay`: replay ShareGPT conversations through the engine, closed loop, offline.

Each human message is one turn; the assistant history is what the model generated. K
conversations run at once; a conversation's next turn is submitted when its reply finishes.
Finished turns are committed to the LMDB store, so replaying into the same --data-dir later
continues each conversation with the turns not yet answered.
"""

from __future__ import annotations

import sys
import tempfile
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec
import orjson
from tqdm import tqdm

from pensieve.actors.config import DEFAULTS
from pensieve.actors.scheduler.conversations import prompt_sources
from pensieve.actors.scheduler.request import FinishReason, Request
from pensieve.actors.scheduler.turn_commit import commit_turn, turn_record
from pensieve.actors.wire.messages import ChatMessage
from pensieve.actors.wire.step import SamplingParams
from pensieve.ops.factory import Built
from pensieve.ops.sharegpt import Conversation, HumanTurn, Role, human_turns
from pensieve.store import ConversationStore, StoreWriter, TurnRecord


class ContextTooLong(ValueError):
    """A turn's prompt does not fit in the model's context."""


@dataclass(frozen=True)
class ReplayOptions:
    max_new_tokens: int | None = DEFAULTS.max_tokens  # None: the recorded reply's length
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    concurrency: int = 4
    seed: int = 0
    emit_token_ids: bool = False
    skip_too_long: bool = False  # end a conversation whose prompt outgrows the context
    max_turns: int | None = None


@dataclass
class Session:
    """One conversation being replayed."""

    conv: Conversation
    turns: list[HumanTurn]
    messages: list[ChatMessage]
    next_turn: int
    log: list[int]
    user_message: str = ""
    started_at: float = 0.0


@dataclass
class ReplaySummary:
    turns: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    sources: list[dict[str, int]] = field(default_factory=list)  # each turn's prompt_sources
    new_prompt_tokens: int = 0
    seconds: float = 0.0
    skipped_conversations: int = 0


def replay(
    built: Built,
    conversations: list[Conversation],
    options: ReplayOptions,
    out: IO[bytes],
    data_dir: Path | None,
) -> ReplaySummary:
    with tempfile.TemporaryDirectory() as scratch:
        store = ConversationStore(data_dir or Path(scratch))
        with store, StoreWriter() as writer:
            store.clear_spills()  # the CPU tier does not survive a restart
            return _Replayer(built, options, out, store, writer).run(conversations)


class _Replayer:
    def __init__(
        self,
        built: Built,
        options: ReplayOptions,
        out: IO[bytes],
        store: ConversationStore,
        writer: StoreWriter,
    ) -> None:
        self.engine = built.engine
        self.chat = built.chat
        self.max_len = built.engine.max_model_len
        self.options = options
        self.out = out
        self.store = store
        self.writer = writer
        self.summary = ReplaySummary()

    def run(self, conversations: list[Conversation]) -> ReplaySummary:
        sessions = deque(s for s in map(self._session, conversations) if s is not None)
        total = sum(len(s.turns) - s.next_turn for s in sessions)
        active: dict[str, Session] = {}
        begin = time.perf_counter()
        with tqdm(total=total, desc="turns", unit="turn", file=sys.stderr, disable=None) as bar:
            while sessions or active:
                while sessions and len(active) < self.options.concurrency:
                    session = sessions.popleft()
                    if self._submit(session):
                        active[session.conv.id] = session
                if not active:
                    break
                for request in self.engine.step().finished:
                    session = active[request.conv_id]
                    self._finish(session, request)
                    bar.update(1)
                    if not self._submit(session):
                        del active[request.conv_id]
        self.writer.flush()
        self.summary.seconds = time.perf_counter() - begin
        return self.summary

    def _session(self, conv: Conversation) -> Session | None:
        turns = list(human_turns(conv))
        if self.options.max_turns is not None:
            turns = turns[: self.options.max_turns]
        messages: list[ChatMessage] = [
            {"role": "system", "content": m.text} for m in conv.turns[:1] if m.role is Role.SYSTEM
        ]
        done = self.store.turns(conv.id)
        for record in done:
            messages.append({"role": "user", "content": record.user_message})
            messages.append({"role": "assistant", "content": record.assistant_text})
        log = self.store.token_log(conv.id)
        if log:
            self.engine.restore(conv.id, log)
        if len(done) >= len(turns):
            return None
        return Session(conv, turns, messages, len(done), log)

    def _submit(self, session: Session) -> bool:
        """Submit the session's next turn; False when it has none (or it no longer fits)."""
        if session.next_turn >= len(session.turns):
            return False
        turn = session.turns[session.next_turn]
        messages = [*session.messages, {"role": "user", "content": turn.text}]
        prompt = self.chat.render(messages)
        max_tokens = self._max_tokens(turn)
        if len(prompt) + 1 > self.max_len:
            if self.options.skip_too_long:
                self.summary.skipped_conversations += 1
                return False
            raise ContextTooLong(
                f"conversation {session.conv.id!r} turn {session.next_turn}: prompt of "
                f"{len(prompt)} tokens exceeds the model's context of {self.max_len} "
                "(pass --skip-too-long to end such conversations instead)"
            )
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.options.temperature,
            top_p=self.options.top_p,
            seed=zlib.crc32(f"{self.options.seed}:{session.conv.id}:{session.next_turn}".encode()),
            ignore_eos=self.options.ignore_eos,
        )
        session.user_message = turn.text
        session.started_at = time.time()
        self.engine.add_request(session.conv.id, prompt, sampling)
        return True

    def _max_tokens(self, turn: HumanTurn) -> int:
        if self.options.max_new_tokens is not None:
            return self.options.max_new_tokens
        return max(1, len(self.chat.encode(turn.reply or "")))

    def _finish(self, session: Session, request: Request) -> None:
        if request.finish_reason is FinishReason.ABORT:
            raise ContextTooLong(f"conversation {session.conv.id!r}: {request.error}")
        text = self.chat.decode(request.output_ids)
        record = turn_record(
            session.next_turn, session.user_message, text, request, session.started_at
        )
        log = request.all_ids
        commit_turn(self.store, self.writer, session.conv.id, record, session.log, log)
        session.log = log
        session.messages += [
            {"role": "user", "content": session.user_message},
            {"role": "assistant", "content": text},
        ]
        session.next_turn += 1
        self._emit(session, request, record)

    def _emit(self, session: Session, request: Request, record: TurnRecord) -> None:
        sources = prompt_sources(record)
        line = {
            "conversation_id": session.conv.id,
            "turn": record.turn,
            "prompt_tokens": record.prompt_tokens,
            "new_prompt_tokens": record.new_prompt_tokens,
            "output_token_ids": request.output_ids,
            "output_text": record.assistant_text,
            "finish_reason": record.finish_reason,
            "cached_tokens": sources.cached,
            "prompt_sources": msgspec.structs.asdict(sources),
            "ttft_s": (request.first_token_time or request.arrival) - request.arrival,
            "latency_s": (request.finish_time or request.arrival) - request.arrival,
            "suspensions": request.num_suspensions,
            "swapped_bytes": {
                "in": request.swapped_in_blocks * self.engine.block_bytes,
                "out": request.swapped_out_blocks * self.engine.block_bytes,
            },
        }
        if self.options.emit_token_ids:
            line["prompt_token_ids"] = request.prompt_ids
        self.out.write(orjson.dumps(line) + b"\n")
        s = self.summary
        s.turns += 1
        s.output_tokens += len(request.output_ids)
        s.prompt_tokens += record.prompt_tokens
        s.new_prompt_tokens += record.new_prompt_tokens
        s.sources.append(msgspec.structs.asdict(sources))
