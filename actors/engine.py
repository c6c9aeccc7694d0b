"""The engine: scheduler + cache manager + executor in one synchronous step loop (no I/O).

`pensieve replay` drives it directly; the async actor shells drive the same cores over NATS.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

from pensieve.actors.config import CacheConfig, SchedulerConfig
from pensieve.actors.executor import ModelRunner
from pensieve.actors.kv_manager import CostFn, KVCacheManager
from pensieve.actors.request import Request, SamplingParams, TokenSources
from pensieve.actors.scheduler import Scheduler, StepOutcome

tracer = trace.get_tracer("pensieve.engine")


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

    def step(self) -> StepOutcome:
        plan = self.scheduler.schedule(self.clock())
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
                sampled = self.runner.execute(plan)
        else:
            sampled = self.runner.execute(plan)
        outcome = self.scheduler.update(plan, sampled, self.clock())
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
