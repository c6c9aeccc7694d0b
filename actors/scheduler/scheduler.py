"""The unified iteration-level scheduler: prefill and decode tokens of many requests in one step.

Every request is "computed positions vs target positions": each step gives every running request
its next pending positions (a decode is one position) under a token budget, first come first
served, then admits waiting requests while the GPU keeps its reserve.

A planned sample makes its position pending at once (`Request.expect_sample`), so the next step
can be planned before this one's tokens are known: the engine overlaps planning with the device.
Its token is applied by `update`; a request that ends meanwhile (an end-of-sequence token) has
its pieces in the step planned ahead ignored.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pensieve.actors.config import SchedulerConfig
from pensieve.actors.scheduler.kv.kv_cache import ConversationKV
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.scheduler.kv.tier_moves import OutOfBlocks
from pensieve.actors.scheduler.request import (
    FinishReason,
    Request,
    RequestStatus,
    TokenSources,
    common_prefix,
)
from pensieve.actors.scheduler.step_budget import (
    PrefillBudget,
    StepPrefill,
    StepTimeModel,
    is_decode,
)
from pensieve.actors.wire.step import DiskRead, SeqPiece, StepPlan


@dataclass(frozen=True)
class Suspension:
    """A running request pushed off the GPU to make room (it waits to be admitted again)."""

    request: Request
    at: float  # when, on the engine's clock
    num_positions: int  # the positions it keeps, to bring back when it is readmitted
    swapped_out_blocks: int  # blocks copied to the CPU tier for it now


@dataclass(frozen=True)
class StepOutcome:
    new_tokens: dict[str, int]  # request_id -> token sampled this step
    finished: list[Request]
    suspended: list[Suspension] = field(default_factory=list)  # since the step before


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, step_time: StepTimeModel | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        # caps prefill beside decodes (step_budget.py); None: only the step's token budget
        self.prefill_budget = (
            PrefillBudget(step_time, config.max_step_slowdown, config.min_prefill_tokens)
            if step_time is not None and config.max_step_slowdown is not None
            else None
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.histories: dict[str, list[int]] = {}  # conversation -> its token log
        self.num_suspensions = 0
        self.recompute_plans = {"foreseen": 0, "differed": 0}
        self.rejected: list[Request] = []  # drained by the engine
        self.suspended: list[Suspension] = []  # drained by the engine
        self.live: dict[str, Request] = {}  # unfinished requests, waiting or running
        # disk reads of requests admitted since the last step was launched: the engine
        # releases them once that step's loads are issued
        self.disk_reads_done: list[DiskRead] = []

    def add(self, request: Request) -> None:
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens leaves no room in a context of "
                f"{self.config.max_model_len}"
            )
        if any(r.conv_id == request.conv_id for r in (*self.running, *self.waiting)):
            raise ValueError(f"conversation {request.conv_id!r} already has a turn in progress")
        self.waiting.append(request)
        self.live[request.request_id] = request
        self.kv.touch(request.conv_id, request.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_active_tokens(self) -> int:
        """The tokens of the requests in hand, running and waiting: their KV is needed now."""
        return sum(r.num_tokens for r in (*self.running, *self.waiting))

    def stop_at(self, request: Request, num_output: int, now: float) -> bool:
        """End a request with its first `num_output` tokens (a stop string completes at the
        last of them): at once if it runs, or cut back if it has ended meanwhile (an
        end-of-sequence token, its length). Tokens after them are discarded and so is their KV,
        so the conversation is as if the request had stopped there. False if it is suspended:
        it ends at its next token."""
        request.stop_at = num_output
        if request.status is RequestStatus.FINISHED:
            self._cut(request)
            request.finish_reason = FinishReason.STOP
            return True
        if request not in self.running:
            return False
        self._finish(request, FinishReason.STOP, now)
        return True

    def cancel(self, request: Request, now: float) -> bool:
        """End a request before its end, as its requester asked: a running one keeps what it
        computed (as at a normal end), one never admitted leaves the queue. False if neither
        (a suspended one, whose KV is moving: cancel it once it runs again)."""
        if request in self.running:
            self._finish(request, FinishReason.CANCELLED, now)
            return True
        if request.admitted_at is not None or request.inflight or request not in self.waiting:
            return False
        self.waiting.remove(request)
        self.kv.unwait(request.conv_id)
        del self.live[request.request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.CANCELLED
        request.finish_time = now
        return True

    def forget(self, conv_id: str) -> None:
        """Drop a conversation's token log; its KV is the cache manager's to forget."""
        self.histories.pop(conv_id, None)

    def abort_all(self, error: str, now: float) -> list[Request]:
        """Finish every waiting and running request with `error`, giving back none of their KV
        (the caller forgets all of it); returns them."""
        aborted = [*self.running, *self.waiting]
        for request in aborted:
            _release_read(request)
            request.pending = []
            request.inflight = request.unapplied = 0
            request.status = RequestStatus.FINISHED
            request.finish_reason = FinishReason.ABORT
            request.error = error
            request.finish_time = now
        self.live.clear()
        self.running.clear()
        self.waiting.clear()
        return aborted

    def restore_history(self, conv_id: str, tokens: list[int], now: float) -> None:
        """Adopt a conversation known only from its token log (e.g. after a restart)."""
        if conv_id in self.histories:
            return
        self.histories[conv_id] = list(tokens)
        # the last token of a turn was sampled, never fed: its KV does not exist
        self.kv.restore(conv_id, max(len(tokens) - 1, 0), now)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        prefill = self._step_prefill()
        pieces: list[SeqPiece] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING or not request.pending:
                continue  # suspended while an earlier request grew; or its last token is out
            limit = prefill.limit(request.pending, budget)
            if limit == 0:
                continue  # a prefill beyond the step's prefill cap
            taken = self._grow_or_suspend(request, limit, now)
            prefill.took(taken)
            pieces += self._pieces(request, taken)
            budget -= sum(end - start for start, end in taken)
        if self._defer_admission(pieces):
            return self._plan(pieces, prefill)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if not prefill.has_room():
                break
            head = self.waiting[0]
            reading = head.disk_read is not None and not head.disk_read.done()
            if head.unapplied or reading or not self._admit(head, now):
                # (a suspended request whose pieces are still being computed waits for them,
                # and one whose history is being read from disk for that read)
                break
            request = self.waiting.popleft()
            taken = request.take(prefill.limit(request.pending, budget))
            prefill.took(taken)
            pieces += self._pieces(request, taken)
            budget -= sum(end - start for start, end in taken)
        # ahead-of-time swap-outs are chosen by the engine while the device runs a step
        return self._plan(pieces, prefill)

    def _step_prefill(self) -> StepPrefill:
        """The prefill cap of the step about to be planned, by the decodes it will carry."""
        if self.prefill_budget is None:
            return StepPrefill(None, ())
        decodes, prefilling = [], 0
        for r in self.running:
            if r.status is RequestStatus.RUNNING and r.pending:
                if is_decode(r.pending):
                    decodes.append(r.pending[0][1])
                else:
                    prefilling += 1
        contended = prefilling + len(self.waiting) > 1
        return StepPrefill(self.prefill_budget, decodes, contended)

    def _plan(self, pieces: list[SeqPiece], prefill: StepPrefill) -> StepPlan:
        return StepPlan(tuple(pieces), self.kv.take_orders(), prefill_cap=prefill.cap)

    def _defer_admission(self, pieces: list[SeqPiece]) -> bool:
        """Whether this step admits nobody: it would decode only, and fewer running slots are
        free than the admit group (or than the requests waiting, if fewer wait).

        A step with a multi-token piece replays graphs cut at attention, with attention launched
        between them; a pure-decode step replays one whole CUDA graph. At the running-request
        cap, requests finish one or two at a time, and admitting each into the next slot would
        make most steps mixed ones carrying a single short prompt (a stateful turn's new prompt
        is small). Waiting until a few slots are free
        starts those turns together in one mixed step; below the cap, and whenever a step has
        prefill work anyway, requests are admitted at once."""
        if not self.waiting or not self.running or any(p.end - p.start > 1 for p in pieces):
            return False
        free = self.config.max_num_seqs - len(self.running)
        return free < min(self.config.admit_group, len(self.waiting))

    def update(self, plan: StepPlan, sampled: list[int], now: float) -> StepOutcome:
        """Apply a finished step: record computed positions and sampled tokens (steps are
        applied in the order they were planned)."""
        new_tokens: dict[str, int] = {}
        finished: list[Request] = []
        samples = iter(sampled)
        for piece in plan.pieces:
            token = next(samples) if piece.sampling is not None else None
            request = self.live.get(piece.request_id)
            if request is None:
                continue  # it ended after this step was planned: its positions are not kept
            request.unapplied -= 1
            conv = self.kv.conversations[request.conv_id]
            conv.num_positions = max(conv.num_positions, piece.end)
            if token is None:
                continue
            request.inflight -= 1
            request.output_ids.append(token)
            new_tokens[request.request_id] = token
            if request.first_token_time is None:
                request.first_token_time = now
            else:
                request.token_gaps.append(now - (request.last_token_time or now))
            request.last_token_time = now
            reason = request.finish_check(self.config.max_model_len)
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
        return StepOutcome(new_tokens, finished)

    # ---- internals -----------------------------------------------------------------------

    def _pieces(self, request: Request, taken: list[tuple[int, int]]) -> list[SeqPiece]:
        if not taken:
            return []
        conv = self.kv.conversations[request.conv_id]
        table = request.block_table
        if len(table) != len(conv.chunks):
            grown = [chunk.gpu_block for chunk in conv.chunks[len(table) :]]
            assert None not in grown, f"{conv.conv_id}: a running chunk is off the GPU"
            table = request.block_table = table + tuple(grown)  # type: ignore[arg-type]
        pieces = []
        request.unapplied += len(taken)
        for start, end in taken:
            samples = end == request.num_tokens and not request.pending
            index = len(request.output_ids) + request.inflight  # which output token it samples
            output = None
            needs_output = request.sampling.grammar is not None or request.sampling.penalized
            if samples and needs_output and not request.inflight:
                output = tuple(request.output_ids)
            if samples:
                request.expect_sample(self.config.max_model_len)
            pieces.append(
                SeqPiece(
                    request.request_id,
                    request.token_slice(start, end),
                    start,
                    end,
                    table,
                    request.sampling if samples else None,
                    index,
                    output,
                )
            )
        return pieces

    def _grow_or_suspend(self, request: Request, budget: int, now: float) -> list[tuple[int, int]]:
        conv = self.kv.conversations[request.conv_id]
        end = request.peek_end(budget)
        while not self.kv.grow(conv, end, now):
            # the latest arrival gives way (running is in arrival order); one whose last token
            # is already being sampled is about to end, which frees its blocks anyway
            victim = next(r for r in reversed(self.running) if r.pending)
            self._suspend(victim, now)
            if victim is request:
                return []
        return request.take(budget)

    def _suspend(self, request: Request, now: float) -> None:
        conv = self.kv.conversations[request.conv_id]
        kept = request.first_pending
        copied = self.kv.suspend(conv, kept, now, self._tokens(request))
        request.swapped_out_blocks += copied
        self.suspended.append(Suspension(request, now, kept, copied))
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.pending = []  # an in-flight token is applied while it waits
        request.num_suspensions += 1
        self.num_suspensions += 1
        self.waiting.appendleft(request)

    def _admit(self, request: Request, now: float) -> bool:
        """Reuse the longest cached prefix: the conversation's own up to where the prompt
        differs from its token log, extended by full chunks found by content (`_reuse`); take
        GPU blocks for the rest."""
        conv = self.kv.conversation(request.conv_id, now, request.cache_namespace)
        target = request.all_ids
        # keep the reserve while others run; an idle GPU admits whatever fits at all
        if not self.kv.can_admit(conv, len(target)) and self.running:
            return False
        reuse, shared = self._reuse(request, conv, target)
        try:
            on_disk = request.disk_read.found() if request.disk_read is not None else frozenset()
            acquired = self.kv.acquire(conv, len(target), now, on_disk)
        except OutOfBlocks:
            if not self.running:
                self._reject(request, now)  # it can never fit, even on an idle GPU
            return False
        request.block_table = ()  # its blocks may all be new
        request.pending = [*acquired.recompute_ranges, (reuse, len(target))]
        if not request.num_suspensions and request.planned_recompute is not None:
            # the tiers may change between its arrival and its admission
            foreseen = request.planned_recompute == acquired.recompute_ranges
            self.recompute_plans["foreseen" if foreseen else "differed"] += 1
        if not request.num_suspensions:
            # where the turn's prompt came from, once: a suspended turn readmitted brings back
            # positions already counted (its swap-ins still count as swapped-in blocks)
            request.sources = TokenSources(
                gpu=acquired.gpu_tokens,
                cpu=acquired.cpu_tokens,
                recomputed=acquired.recomputed_tokens,
                new=len(target) - reuse,
                shared=shared,
                disk=acquired.disk_tokens,
            )
        request.swapped_in_blocks += acquired.swapped_in
        if request.disk_read is not None:  # loaded by the step this admission goes into
            self.disk_reads_done.append(request.disk_read)
            request.disk_read = None
        if request.admitted_at is None:  # a suspended turn readmitted keeps its first admission
            request.admitted_at = now
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.arrival)
        return True

    def _reuse(self, request: Request, conv: ConversationKV, target: list[int]) -> tuple[int, int]:
        """Cut the conversation's KV where `target` departs from its token log, then (with
        prefix sharing) extend it by the full chunks of `target` cached by content; returns the
        positions reused and how many of them came from chunks found by content. From here the
        conversation's KV is that of `target`'s first positions, so its token log is `target`."""
        if self.kv.config.prefix_sharing and request.cache_namespace is not None:
            self.kv.rekey(conv, request.cache_namespace)
        reuse = common_prefix(self.histories.get(request.conv_id, []), target)
        reuse = min(reuse, conv.num_positions, len(target) - 1)  # compute >= 1 token for logits
        self.kv.truncate(conv, reuse)
        shared = 0
        if self.kv.config.prefix_sharing:
            on_disk = request.disk_read.found() if request.disk_read is not None else ()
            found = self.kv.lookup(conv, target[: len(target) - 1], on_disk)
            reuse = max(reuse, found.num_positions)
            shared = found.gpu_tokens + found.cpu_tokens
        self.histories[request.conv_id] = list(target)
        return reuse, shared

    def _reject(self, request: Request, now: float) -> None:
        self.waiting.remove(request)
        self.kv.unwait(request.conv_id)
        del self.live[request.request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT
        request.error = "too_long: the conversation does not fit in the GPU KV cache"
        _release_read(request)
        request.finish_time = now
        self.rejected.append(request)

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        """End a turn (running, or suspended with its last token in flight); tokens sampled
        after its last one are discarded, as its last token is never fed."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        request.pending = []
        request.inflight = request.unapplied = 0
        _release_read(request)
        del self.live[request.request_id]
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.histories[request.conv_id] = request.all_ids
        self._cut(request)
        self.kv.release(self.kv.conversations[request.conv_id], now, self._tokens(request))
        if request.conv_id not in self.kv.conversations:
            self.histories.pop(request.conv_id, None)  # stateless: forgotten with its KV

    def _tokens(self, request: Request) -> list[int] | None:
        """The conversation's token log to seal its full chunks by (None: no sharing)."""
        return request.all_ids if self.kv.config.prefix_sharing else None

    def _cut(self, request: Request) -> None:
        """Discard a finished request's tokens after its `stop_at`, and their KV."""
        if request.stop_at is None or len(request.output_ids) <= request.stop_at:
            return
        del request.output_ids[request.stop_at :]
        if request.conv_id in self.histories:  # (a stateless one is forgotten already)
            self.histories[request.conv_id] = request.all_ids
        conv = self.kv.conversations.get(request.conv_id)
        if conv is not None:  # its last token is never fed: the KV ends before it
            self.kv.truncate(conv, len(request.all_ids) - 1)


def _release_read(request: Request) -> None:
    """A turn that ends before its admission needs its disk read no more."""
    if request.disk_read is not None:
        request.disk_read.release()
        request.disk_read = None
