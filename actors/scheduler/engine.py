"""The engine: scheduler + cache manager + executor in one step loop (no I/O).

`pensieve replay` drives it directly and `pensieve serve` from its engine thread; callers use
the methods here, never the parts behind them.

With `overlap` (the default) the loop keeps the device one step ahead of the host: each call
plans and launches step N+1 while step N runs, then waits for step N's tokens and applies them.
Step N+1's decodes read step N's tokens on the device, so the host's planning, input building and
bookkeeping hide behind the device's work instead of leaving it idle between steps. The price is
one step of delay for whatever arrives (a new turn joins a step later) and, for a turn that ends
on an end-of-sequence token, one wasted decode position.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pensieve.actors.config import CacheConfig, Policy, SchedulerConfig
from pensieve.actors.scheduler.kv.kv_manager import CostFn, KVCacheManager
from pensieve.actors.scheduler.request import Request, TokenSources
from pensieve.actors.scheduler.scheduler import Scheduler, StepOutcome
from pensieve.actors.scheduler.step_budget import StepTimeModel
from pensieve.actors.scheduler.step_timing import StepTiming
from pensieve.actors.wire import tracing
from pensieve.actors.wire.chunk_keys import Namespace, PublicKeys, turn_namespace
from pensieve.actors.wire.messages import KvEvent
from pensieve.actors.wire.step import (
    ConversationTraces,
    CopyTrace,
    DiskRead,
    DiskReads,
    Launch,
    SamplingParams,
    StepPlan,
    StepRunner,
    SwapOrders,
    SwapStats,
    TraceContexts,
)

# how long a step with nothing to run waits for a turn's disk read before it returns (its
# caller takes new work between steps)
READ_WAIT_S = 0.005


@dataclass
class EngineTotals:
    steps: int = 0
    requests: int = 0  # finished, with their tokens below
    prompt_tokens: int = 0
    output_tokens: int = 0
    sources: TokenSources = TokenSources()


class Engine:
    def __init__(
        self,
        runner: StepRunner,
        cache: CacheConfig,
        scheduling: SchedulerConfig,
        cost: CostFn,
        eos_token_ids: frozenset[int],
        clock: Callable[[], float] = time.monotonic,
        overlap: bool = True,
        model_id: str = "",
        step_time: StepTimeModel | None = None,  # caps prefill beside decodes (None: no cap)
        public: PublicKeys | None = None,
        disk: DiskReads | None = None,
    ) -> None:
        """`model_id` names the model in the chunk keys (`namespace`); `public`: the keys of
        the prompts the operator names public, shared across tenants; `disk`: the executor's
        disk tier (in this process, or asked over the bus: `RemoteDisk`), with a cache config
        that uses it."""
        self.runner = runner
        self.disk = disk if cache.disk_tier else None
        self.model_id = model_id
        self.public = public
        self.kv = KVCacheManager(cache, cost, self.namespace(None))
        if self.disk is not None:
            self.kv.attach_disk(self.disk.num_slots, self.disk.keys(), self._worth_reading)
        self.scheduler = Scheduler(scheduling, self.kv, step_time)
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.totals = EngineTotals()
        self._ids = itertools.count()
        self.last_timing: StepTiming | None = None
        self.num_read_waits = 0  # steps that had nothing to run and waited for a disk read
        self.overlap = overlap
        self._inflight: Launch | None = None  # launched, its tokens not applied yet
        self._busy_s = 0.0  # the runner's device time in steps when the last one was applied
        # host work that needs no sampled token, done while the step waits for the device (it
        # is given the step waited for, and may return before or after that step is done)
        self.while_waiting: Callable[[Launch], None] | None = None
        self._traces: TraceContexts | None = None  # see `trace_requests`
        self._copy_traces: ConversationTraces | None = None
        self._kv_follower: Callable[[list[KvEvent]], None] | None = None

    def add_request(
        self,
        conv_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        planned_recompute: tuple[tuple[int, int], ...] | None = None,
        cache_namespace: Namespace | None = None,
    ) -> Request:
        """`cache_namespace` (`namespace`): whose cached prefixes the turn may reuse, and who
        may reuse its own; None: the engine's (the model's, no tenant)."""
        if sampling.min_tokens and not sampling.eos_ids:  # what min_tokens holds back
            ends = self.eos_token_ids | set(sampling.stop_token_ids)
            sampling = dataclasses.replace(sampling, eos_ids=tuple(sorted(ends)))
        request = Request(
            request_id=f"{conv_id}#{next(self._ids)}",
            conv_id=conv_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            arrival=self.clock(),
            eos_token_ids=self.eos_token_ids,
            planned_recompute=planned_recompute,
            cache_namespace=cache_namespace,
        )
        self.scheduler.add(request)
        request.disk_read = self._read_from_disk(request)
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def namespace(self, tenant: str | None, cache_salt: str | None = None) -> Namespace:
        """The sharing namespace of a turn of `tenant` (None: the service's own) with
        `cache_salt` (`chunk_keys.turn_namespace`)."""
        return turn_namespace(self.model_id, self.public, tenant, cache_salt)

    # ---- what callers ask of the engine -------------------------------------------------

    @property
    def cache_config(self) -> CacheConfig:
        return self.kv.config

    @property
    def max_model_len(self) -> int:
        """The longest conversation, prompt and reply, that a turn may reach."""
        return self.scheduler.config.max_model_len

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (suspended ones included)."""
        return len(self.scheduler.waiting)

    @property
    def num_suspensions(self) -> int:
        return self.scheduler.num_suspensions

    @property
    def block_bytes(self) -> int:
        """Bytes of one chunk's KV over every layer: what one swapped block moves."""
        return self.runner.block_bytes

    def swap_stats(self) -> SwapStats:
        """Swap totals since start, waiting for the copies still in flight."""
        return self.runner.swap_stats()

    def take_kv_events(self) -> list[KvEvent]:
        """What happened to which chunk since the last call, in order (the KV event plane).
        Recording starts with the first call: make it before the first step. They go to the
        follower set by `follow_kv_events` too."""
        events = self.kv.take_events()
        if events and self._kv_follower is not None:
            self._kv_follower(events)
        return events

    def follow_kv_events(self, follower: Callable[[list[KvEvent]], None] | None) -> None:
        """Hand `follower` every batch of events `take_kv_events` takes (None: no one): the
        spill index of a swap manager in this thread, where no event plane reaches it."""
        self._kv_follower = follower

    def trace_requests(
        self, contexts: TraceContexts | None, conversations: ConversationTraces | None = None
    ) -> None:
        """While tracing is on, the executor traces each request's phases under the trace that
        `contexts` gives for it; it asks when the request first comes to it (None: no one).
        Each step's copies are traced there too, under the traces `conversations` gives for
        the conversations whose chunks they move (`CopyTrace`)."""
        self._traces = contexts
        self._copy_traces = conversations

    def restore(self, conv_id: str, token_log: list[int]) -> None:
        """Adopt a conversation known only from its token log (after a restart): all of its KV
        counts as dropped, so its next turn recomputes it."""
        self.scheduler.restore_history(conv_id, token_log, self.clock())

    def forget(self, conv_id: str) -> None:
        """Forget a conversation that has no turn in flight: its token log and its KV."""
        self.scheduler.forget(conv_id)
        self.kv.forget(conv_id)

    def stop_at(self, request: Request, num_output: int) -> bool:
        """End a request with its first `num_output` tokens, where a stop string completes
        (`Scheduler.stop_at`); False if it is suspended and ends at its next token."""
        before = len(request.output_ids)
        finished = request.finish_reason is not None
        stopped = self.scheduler.stop_at(request, num_output, self.clock())
        if finished:  # counted in the totals already, with the tokens now discarded
            self.totals.output_tokens -= before - len(request.output_ids)
        elif stopped:
            self._count(request)
        return stopped

    def cancel(self, request: Request) -> bool:
        """End a request now, as its requester asked (`Scheduler.cancel`); False if it cannot
        end before it runs again."""
        return self.scheduler.cancel(request, self.clock())

    def abort_all(self, error: str) -> list[Request]:
        """Recover from a step that raised: abort every request in flight and forget all KV.

        The failed step's plan had already taken its requests' positions and issued its swap
        orders, so neither those requests nor any chunk a copy touched can be trusted. Every
        conversation is kept as history with all chunks dropped (as after a restart), so its next
        turn recomputes the KV from its tokens and the output does not change.
        """
        self.runner.settle()
        self._inflight = None
        now = self.clock()
        aborted = self.scheduler.abort_all(error, now)
        for conv_id in list(self.kv.conversations):
            self.kv.forget(conv_id)
        self.kv.take_orders()  # the cancelled copies, and slots freed for the next step
        if self.disk is not None:  # its cancelled removals and saves: the books afresh
            self.kv.attach_disk(self.disk.num_slots, self.disk.keys(), self._worth_reading)
        if self.kv.config.policy is Policy.STATELESS:
            self.scheduler.histories.clear()  # only turns in flight had one
        for conv_id, tokens in self.scheduler.histories.items():
            self.kv.restore(conv_id, max(len(tokens) - 1, 0), now)
        return aborted

    def write_back(self) -> int:
        """On a clean stop (no step in flight): write every sealed chunk of the GPU and CPU
        tiers to the disk tier, so a restarted engine reads them back; the chunks on disk now.
        A crash skips this and loses them, as it loses the tiers."""
        if self.disk is None:
            return 0
        self.runner.settle()
        drops, cpu, gpu = self.kv.disk_write_back(self.clock())
        return self.disk.write_back(drops, cpu, gpu)

    # ---- the step loop ------------------------------------------------------------------

    def step(self) -> StepOutcome:
        """Plan and launch a step; apply the tokens of the step before it (with `overlap`) or
        of this one (without). The outcome is that of the step applied."""
        begin = time.perf_counter()
        if self.disk is not None and not self.disk.writable:
            self.kv.stop_disk_writes()
        plan = self.scheduler.schedule(self.clock())
        scheduled = time.perf_counter()
        launched_step = self._launch(plan)
        for read in self.scheduler.disk_reads_done:  # their chunks are loaded: copies issued
            read.release()
        self.scheduler.disk_reads_done.clear()
        launched = time.perf_counter()
        # while the device runs: choose the next ahead-of-time swap-outs (their copies go out
        # with the next step); nothing here depends on sampled tokens
        self.kv.swap_out_ahead(self.clock())
        self.kv.write_ahead(self.clock())
        chosen = time.perf_counter()
        done = self._inflight if self.overlap else launched_step
        # a step without pieces samples nothing, so nothing waits on it
        self._inflight = launched_step if self.overlap and plan.pieces else None
        if not plan.pieces and (done is None or not done.plan.pieces):
            self._wait_for_a_read()  # nothing ran, nothing runs
        if done is None:  # the first step of a busy period: nothing to apply yet
            self.last_timing = None
            return self._with_rejected(StepOutcome({}, []))
        if self.while_waiting is not None:
            self.while_waiting(done)
            chosen = time.perf_counter()
        sampled = done.result()
        executed = time.perf_counter()
        self._observe(done.plan)
        plan, orders = done.plan, done.plan.orders
        outcome = self.scheduler.update(plan, sampled, self.clock())
        decoding = [piece.end for piece in plan.pieces if piece.end - piece.start == 1]
        decodes = len(decoding)
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
            sum(decoding),
            plan.prefill_cap,
        )
        self.totals.steps += 1
        for request in outcome.finished:
            self._count(request)
        return self._with_rejected(outcome)

    def _wait_for_a_read(self) -> None:
        """Nothing ran and nothing is in flight: if the next turn waits for its disk read,
        wait for that (up to READ_WAIT_S, so that the caller takes new work meanwhile) rather
        than step again at once: stepping for nothing would hold the interpreter the read
        threads need."""
        waiting = self.scheduler.waiting
        read = waiting[0].disk_read if waiting else None
        if read is not None and not read.done():
            self.num_read_waits += 1
            read.wait(READ_WAIT_S)

    def _read_from_disk(self, request: Request) -> DiskRead | None:
        """Start reading the chunks of the turn's history that are on the disk tier only, where
        reading one back costs less than recomputing it (`Cost(l)` of the chunk ending at `l`
        against its bytes over the disk's read rate: the leading chunks of a short context may
        be cheaper to recompute). The turn is admitted once the read is done."""
        if self.disk is None:
            return None
        kv, block = self.kv, self.kv.config.block_size
        conv = kv.get(request.conv_id)
        space = request.cache_namespace or (conv.namespace if conv is not None else kv.namespace)
        keys = list(conv.keys) if conv is not None and conv.namespace == space else []
        space.extend(keys, request.prompt_ids[: len(request.prompt_ids) - 1], block)
        wanted = []
        for i, key in enumerate(keys):
            own = conv.chunks[i] if conv is not None and i < len(conv.chunks) else None
            sealed = kv.index.get(key)
            if (own is not None and kv.place(own)) or (sealed is not None and kv.place(sealed)):
                continue  # cached on the GPU or the CPU tier
            if self._worth_reading(i):
                wanted.append(key)
        return self.disk.read(wanted) if wanted else None

    def _worth_reading(self, index: int) -> bool:
        """Reading the chunk at `index` of a context back from disk costs less than recomputing
        it: `Cost(l)` of the chunk ending at `l` against its bytes over the disk's read rate."""
        assert self.disk is not None
        block = self.kv.config.block_size
        return self.kv.cost((index + 1) * block) > self.disk.read_seconds_per_chunk

    def _count(self, request: Request) -> None:
        """A finished request, in the totals."""
        self.totals.requests += 1
        self.totals.prompt_tokens += len(request.prompt_ids)
        self.totals.output_tokens += len(request.output_ids)
        self.totals.sources = self.totals.sources + request.sources

    def load(self) -> dict[str, Any]:
        """What a load report reads of `stats` (`load_reporter.load_report`): the requests in
        hand and the GPU tier's free blocks, cheap enough to read after any step."""
        kv = self.kv
        return {
            "requests": {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                # the context of the turns in hand, running and waiting: the KV they need now
                "active_tokens": self.scheduler.num_active_tokens,
            },
            "cache": {
                "block_size": kv.config.block_size,
                # reclaimable: swapped out, their data kept until the block is reused
                "gpu_blocks": {
                    "total": kv.gpu.capacity,
                    "free": kv.gpu.num_free,
                    "reclaimable": kv.num_free_gpu - kv.gpu.num_free,
                },
            },
        }

    def stats(self) -> dict[str, Any]:
        """Totals since start (requests finished, their prompt tokens by where they came from,
        swaps, suspensions) and the state now (requests running and waiting, each tier's
        blocks); a consistent snapshot when called between steps, as the server does. Swap
        seconds count only copies the device has finished."""
        totals, kv = self.totals, self.kv
        swaps = self.runner.swap_stats(wait=False)
        load = self.load()
        return {
            "policy": kv.config.policy.value,
            "steps": totals.steps,
            "requests": {
                "finished": totals.requests,
                **load["requests"],
                "suspensions": self.scheduler.num_suspensions,
            },
            # turns admitted with a recompute plan, by whether admission recomputed what it said
            "recompute_plans": dict(self.scheduler.recompute_plans),
            "tokens": {
                "prompt": totals.prompt_tokens,
                "completion": totals.output_tokens,
                "prompt_sources": dataclasses.asdict(totals.sources),
            },
            # vLLM's prefix-cache counters in prompt tokens of finished turns: looked up, and
            # found cached (GPU or CPU tier); `shared_hits` of those found in another
            # conversation's chunks. Sharing's saving now: chunks with several users, and the
            # bytes (over both tiers) one copy per user would take beyond them
            "prefix_cache": {
                "sharing": kv.config.prefix_sharing,
                "queries": totals.prompt_tokens,
                "hits": totals.sources.gpu + totals.sources.cpu + totals.sources.disk,
                "shared_hits": totals.sources.shared,
                "shared_chunks": kv.num_shared_chunks,
                "bytes_saved": kv.num_copies_saved() * self.runner.block_bytes,
            },
            "swaps": {
                "in": {
                    "blocks": swaps.blocks_in,
                    "bytes": swaps.bytes_in,
                    "seconds": swaps.seconds_in,
                },
                "out": {
                    "blocks": swaps.blocks_out,
                    "bytes": swaps.bytes_out,
                    "seconds": swaps.seconds_out,
                },
            },
            "device": dataclasses.asdict(self.runner.device_time()),
            "prefill_budget": self._budget_stats(),
            "cache": {
                **load["cache"],
                "conversations": len(kv.conversations),
                "cpu_blocks": {"total": kv.cpu.capacity, "free": kv.cpu.num_free},
                # chunks saved for the disk tier ahead of and on eviction (`kv/disk_saves.py`)
                "disk_saves": None if kv.disk_saves is None else kv.disk_saves.counts(),
            },
        }

    def _with_rejected(self, outcome: StepOutcome) -> StepOutcome:
        """The outcome, with the requests admission rejected since the last step among the
        finished ones, and the requests suspended since then (also when no step was applied:
        nothing else would report them)."""
        scheduler = self.scheduler
        rejected, scheduler.rejected = scheduler.rejected, []
        suspended, scheduler.suspended = scheduler.suspended, []
        if rejected or suspended:
            return StepOutcome(outcome.new_tokens, outcome.finished + rejected, suspended)
        return outcome

    def _budget_stats(self) -> dict[str, float] | None:
        """The prefill budget's measured step times over its estimates (None: no budget)."""
        budget = self.scheduler.prefill_budget
        if budget is None:
            return None
        calibration = budget.calibration
        return {
            "max_slowdown": budget.max_slowdown,
            "decode_ratio": calibration.decode,
            "prefill_ratio": calibration.prefill,
        }

    def _observe(self, plan: StepPlan) -> None:
        """Tell the prefill budget how long the device spent on the step just applied (its
        busy time since the step before; 0 where the runner measures none)."""
        budget = self.scheduler.prefill_budget
        if budget is None:
            return
        busy = self.runner.device_time().busy_s
        budget.observe(plan, busy - self._busy_s)
        self._busy_s = busy

    def _launch(self, plan: StepPlan) -> Launch:
        if self._traces is not None and tracing.enabled():  # the executor traces its phases
            copies = self._trace_copies(plan.orders)
            plan = dataclasses.replace(plan, traces=self._traces, copy_traces=copies)
        return self.runner.launch(plan, self._inflight)

    def _trace_copies(self, orders: SwapOrders) -> tuple[CopyTrace, ...]:
        """The step's copies by kind and conversation, with the trace each goes in."""
        if self._copy_traces is None or orders.is_empty():
            return ()
        owners = self.kv.copy_owners(orders)
        traces = self._copy_traces({c for counts in owners.values() for c in counts})
        return tuple(
            CopyTrace(kind, conv_id, num, *traces.get(conv_id, ("", "")))
            for kind, counts in owners.items()
            for conv_id, num in counts.items()
        )
