"""The engine: scheduler + cache manager + executor in one synchronous step loop (no I/O).

`pensieve replay` drives it directly; the async actor shells drive the same cores over NATS.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

from pensieve.actors.config import CacheConfig, Policy, SchedulerConfig
from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_manager import CostFn, KVCacheManager
from pensieve.actors.request import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    TokenSources,
)
from pensieve.actors.scheduler import Scheduler, StepOutcome

tracer = trace.get_tracer("pensieve.engine")


@dataclass(frozen=True)
class StepTiming:
    """What the last step did and where its wall time went, in host seconds: scheduling, issuing
    the copies and the forward (`launch_s`), choosing the next ahead-of-time swap-outs while the
    device runs (`ahead_s`), waiting for the sampled tokens (`wait_s`), applying them. A small
    `wait_s` means the device finished before the host did: the host is on the critical path."""

    schedule_s: float
    launch_s: float
    ahead_s: float
    wait_s: float
    update_s: float
    decodes: int  # single-token pieces
    prefill_tokens: int  # tokens of multi-token pieces (new prompt and recomputed history)
    swap_in: int  # blocks
    swap_out: int
    evict_first: int

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.launch_s + self.ahead_s + self.wait_s + self.update_s

    @property
    def kind(self) -> str:
        """decode | mixed | prefill, with "+in" when the step swapped in."""
        shape = "prefill" if not self.decodes else "mixed" if self.prefill_tokens else "decode"
        return shape + ("+in" if self.swap_in else "")


@dataclass
class EngineTotals:
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    sources: TokenSources = TokenSources()


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        cache: CacheConfig,
        scheduling: SchedulerConfig,
        cost: CostFn,
        eos_token_ids: frozenset[int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.kv = KVCacheManager(cache, cost)
        self.scheduler = Scheduler(scheduling, self.kv)
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.totals = EngineTotals()
        self._ids = itertools.count()
        self.last_timing: StepTiming | None = None

    def add_request(self, conv_id: str, prompt_ids: list[int], sampling: SamplingParams) -> Request:
        request = Request(
            request_id=f"{conv_id}#{next(self._ids)}",
            conv_id=conv_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            arrival=self.clock(),
            eos_token_ids=self.eos_token_ids,
        )
        self.scheduler.add(request)
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset(self, error: str) -> list[Request]:
        """Recover from a step that raised: abort every request in flight and forget all KV.

        The failed step's plan had already taken its requests' positions and issued its swap
        orders, so neither those requests nor any chunk a copy touched can be trusted. Every
        conversation is kept as history with all chunks dropped (as after a restart), so its next
        turn recomputes the KV from its tokens and the output does not change.
        """
        self.runner.swap.settle()
        now = self.clock()
        aborted = [*self.scheduler.running, *self.scheduler.waiting]
        for request in aborted:
            request.status = RequestStatus.FINISHED
            request.finish_reason = FinishReason.ABORT
            request.error = error
            request.finish_time = now
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        for conv_id in list(self.kv.conversations):
            self.kv.forget(conv_id)
        self.kv.take_orders()  # the cancelled copies, and slots freed for the next step
        if self.kv.config.policy is Policy.STATELESS:
            self.scheduler.histories.clear()  # only turns in flight had one
        for conv_id, tokens in self.scheduler.histories.items():
            self.kv.restore(conv_id, max(len(tokens) - 1, 0), now)
        return aborted

    def step(self) -> StepOutcome:
        begin = time.perf_counter()
        plan = self.scheduler.schedule(self.clock())
        scheduled = time.perf_counter()
        orders = plan.orders
        if orders.swap_in or orders.swap_out or orders.evict_first:  # a span for steps that move KV
            with tracer.start_as_current_span("step") as span:
                span.set_attributes({
                    "pensieve.swap_in_blocks": len(orders.swap_in),
                    "pensieve.swap_out_blocks": len(orders.swap_out),
                    "pensieve.evict_first_blocks": len(orders.evict_first),
                    "pensieve.sequences": len(plan.pieces),
                    "pensieve.tokens": plan.num_tokens,
                })  # fmt: skip
                tokens = self.runner.launch(plan)
        else:
            tokens = self.runner.launch(plan)
        launched = time.perf_counter()
        # while the device runs the step: choose the next ahead-of-time swap-outs (their copies
        # go out with the next step); nothing here depends on this step's tokens
        self.kv.swap_out_ahead(self.clock())
        chosen = time.perf_counter()
        sampled = tokens.tolist()
        executed = time.perf_counter()
        outcome = self.scheduler.update(plan, sampled, self.clock())
        decodes = sum(1 for piece in plan.pieces if piece.end - piece.start == 1)
        self.last_timing = StepTiming(
            scheduled - begin,
            launched - scheduled,
            chosen - launched,
            executed - chosen,
            time.perf_counter() - executed,
            decodes,
            plan.num_tokens - decodes,
            len(orders.swap_in),
            len(orders.swap_out),
            len(orders.evict_first),
        )
        rejected = self.scheduler.rejected
        self.scheduler.rejected = []
        self.totals.steps += 1
        for request in outcome.finished:
            self.totals.prompt_tokens += len(request.prompt_ids)
            self.totals.output_tokens += len(request.output_ids)
            self.totals.sources = self.totals.sources + request.sources
        if rejected:
            return StepOutcome(outcome.new_tokens, outcome.finished + rejected)
        return outcome
