"""The executor core: runs one step of the model on the paged KV cache and samples.

Per step it issues the step's swaps, builds the attention metadata once (every layer reuses it),
runs the flat batch of query tokens through the model, and samples the pieces that end a request.

Nothing in a launch waits for the device: host inputs go up from pinned memory and the sampled
tokens come back into pinned memory behind an event. So the next step can be launched while this
one runs, its decodes fed the tokens this one samples straight from the device (`feed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pensieve.actors.config import CacheConfig, ExecutorConfig
from pensieve.actors.executor.cuda_graphs import DecodeGraphs
from pensieve.actors.executor.device_clock import DeviceClock
from pensieve.actors.executor.disk_cache import DiskCache
from pensieve.actors.executor.disk_views import host_blocks
from pensieve.actors.executor.grammar import GrammarMasks
from pensieve.actors.executor.penalties import Penalties
from pensieve.actors.executor.piecewise_graphs import PiecewiseGraphs
from pensieve.actors.executor.sampler import apply_token_mask, sample_async
from pensieve.actors.executor.step_tracing import StepTracer
from pensieve.actors.executor.swap import SwapEngine
from pensieve.actors.executor.swap_tracing import SwapTracer
from pensieve.actors.wire import tracing
from pensieve.actors.wire.step import (
    PLACEHOLDER,
    DeviceTime,
    Launch,
    SeqPiece,
    StepPlan,
    SwapOrders,
    SwapStats,
)
from pensieve.kernels import AttentionImpl, AttentionMetadata, build_metadata
from pensieve.kernels.launch import use_fast_launch
from pensieve.kernels.metadata import upload
from pensieve.models.attention import PagedAttention, allocate_kv_caches
from pensieve.models.loader import CausalLM
from pensieve.models.tensor_parallel import TensorShard, broadcast_from_first, prepare_all_reduce


@dataclass
class Launched:
    """A step issued to the device: its sampled tokens, on the device and (once `ready`) on
    the host, one per piece that samples, in the order of the plan as executed (`executed`,
    which may order the pieces otherwise than `plan`; see `decodes_first`)."""

    plan: StepPlan
    tokens: torch.Tensor  # [pieces that sample] long, on the device
    host: torch.Tensor  # its copy in (pinned) host memory
    # a timing event recorded after the copy (see `DeviceClock.waited`); None: done already
    ready: torch.cuda.Event | None
    executed: StepPlan | None = None  # None: `plan` itself
    rows: dict[str, int] = field(init=False)  # request id -> its row of `tokens`
    # told when the tokens reach the host, with the step's number (None: not traced)
    tracer: StepTracer | None = field(default=None, init=False)
    trace_step: int = field(default=0, init=False)
    # traces the copies done by then, of this step and those before (None: not traced)
    swaps: SwapTracer | None = field(default=None, init=False)

    _values: list[int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        ran = self.plan if self.executed is None else self.executed
        sampling = (p.request_id for p in ran.pieces if p.sampling is not None)
        self.rows = {request_id: row for row, request_id in enumerate(sampling)}

    def host_tokens(self) -> list[int]:
        """The sampled tokens in the order executed (waits for the step; no tracing)."""
        if self._values is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._values = self.host.tolist()
        return self._values

    def result(self) -> list[int]:
        """The sampled tokens in `plan`'s order (waits for the step)."""
        swaps, self.swaps = self.swaps, None
        if self.ready is not None:
            if swaps is not None and swaps.clock is not None and not self.ready.query():
                self.ready.synchronize()
                swaps.clock.waited(self.ready)  # it completed just now
            else:
                self.ready.synchronize()
        if self.tracer is not None:
            self.tracer.done(self.trace_step)
            self.tracer = None
        if swaps is not None:
            swaps.collect()
        values: list[int] = self.host.tolist()
        if self.executed is None:
            return values
        rows = self.rows  # a request samples in at most one piece of a step
        return [values[rows[p.request_id]] for p in self.plan.pieces if p.sampling is not None]

    def when_done(self, callback: Callable[[], None]) -> bool:
        return False  # a CUDA event is polled, not awaited


def decodes_first(plan: StepPlan) -> StepPlan:
    """The plan with its single-token pieces (decodes) first, shortest context first, then the
    rest in their order. Attention runs the decodes on tiles of their own, one per decode, the
    highest first: the longest contexts start first, so none of them is left running alone at
    the end of the launch (a step of 250 decodes of mixed lengths runs ~3% faster than in plan
    order). Only the device sees this order: a launch's tokens come back in the plan's
    (`Launched.result`)."""
    pieces = plan.pieces
    singles = sorted((p for p in pieces if p.end - p.start == 1), key=lambda p: p.end)
    if len(singles) == len(pieces):
        ordered = tuple(singles)
    else:
        ordered = (*singles, *(p for p in pieces if p.end - p.start != 1))
    if ordered == pieces:
        return plan
    return StepPlan(ordered, plan.orders)


@dataclass(frozen=True)
class _Inputs:
    meta: AttentionMetadata
    ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    rows: torch.Tensor  # [pieces that sample] long: the row of each one's last token


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        impl: AttentionImpl = AttentionImpl.AUTO,
        cuda_graphs: bool = True,
        swap_out_dma: bool = True,
        swap_batched: bool = True,
        shard: TensorShard | None = None,
        switches: ExecutorConfig | None = None,
        grammars: GrammarMasks | None = None,
    ) -> None:
        """`grammars`: the matchers of constrained requests (None: a step with one fails)."""
        # None: the defaults, as the environment overrides them
        self.switches = switches or ExecutorConfig.from_environment()
        use_fast_launch(self.switches.fast_launch)
        self.model = model
        self.shard = shard  # this rank's part of a model split over ranks (None: all of it)
        self.grammars = grammars
        self.config = model.config
        self.cache = cache
        self.device = device
        self.impl = impl
        # one block more than the manager hands out: the scratch block of padded graph rows
        self.gpu_caches = allocate_kv_caches(
            self.config, cache.num_gpu_blocks + 1, cache.block_size, dtype, device
        )
        num_cpu = cache.num_cpu_blocks if cache.uses_cpu_tier else 0
        pin = device.type == "cuda"
        self.cpu_caches = [
            host_blocks((num_cpu, *c.shape[1:]), dtype, pin) for c in self.gpu_caches
        ]
        self.clock = DeviceClock() if device.type == "cuda" else None
        self.swap = SwapEngine(
            self.gpu_caches, self.cpu_caches, out_dma=swap_out_dma, batched=swap_batched
        )
        self.scale = self.config.attn_scale
        self.disk: DiskCache | None = None  # the disk tier below the CPU tier (None: none)
        self.penalties = Penalties(device)
        # fed only while tracing is on
        self.tracer = StepTracer()
        self.swap_tracer = SwapTracer(self.block_bytes, self.clock)
        if device.type == "cuda" and impl is not AttentionImpl.TORCH:
            # every attention variant a step can launch, compiled now rather than mid-serving
            from pensieve.kernels.triton_attention import compile_variants

            c = self.config
            compile_variants(
                c.num_heads_per_rank,
                c.num_kv_heads_per_rank,
                c.head_dim,
                cache.block_size,
                c.max_context_len,
                dtype,
                device,
            )
        # the row-parallel sums: set up on every rank here, before any graph is captured
        mode = self.switches.all_reduce.value
        self.all_reduce = None if shard is None else prepare_all_reduce(shard, device, mode)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: PiecewiseGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            self.renew_graphs()

    def renew_graphs(self) -> tuple[DecodeGraphs | None, PiecewiseGraphs | None]:
        """New, empty CUDA graphs: pure-decode steps in whole graphs, steps with prefill pieces
        in graphs cut at attention (unless `switches.mixed_graphs` is off); both use the scratch
        block.
        Returns the graphs replaced: a benchmark that changes the model's kernels (`set_fused`)
        captures again, keeping the old graphs, and so their memory pools, alive."""
        old = self.graphs, self.mixed_graphs
        c = self.cache
        self.graphs = DecodeGraphs(
            self.model,
            self.gpu_caches,
            c.num_gpu_blocks,
            c.block_size,
            self.config.max_context_len,
            self.scale,
            self.impl,
        )
        self.mixed_graphs = (
            PiecewiseGraphs(self.model, self.gpu_caches, c.num_gpu_blocks * c.block_size, self.impl)
            if self.switches.mixed_graphs
            else None
        )
        return old

    def capture_graphs(self, max_batch: int, max_tokens: int) -> tuple[int, int]:
        """Capture now every CUDA graph a server can use: pure-decode steps of up to
        `max_batch` sequences at every context bucket the GPU tier holds, and steps with prefill
        of up to `max_tokens` tokens. Met first in the middle of serving, each capture would
        stall every running request for tens of milliseconds. Returns (decode graphs, step
        sizes); (0, 0) without graphs."""
        decodes = steps = 0
        if self.graphs is not None:
            tier = self.cache.num_gpu_blocks * self.cache.block_size
            decodes = self.graphs.capture_all(max_batch, max_context=tier)
        if self.mixed_graphs is not None:
            steps = self.mixed_graphs.capture_all(max_tokens)
        return decodes, steps

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Every step inside runs without CUDA graphs (benchmarks time both ways)."""
        kept = self.graphs, self.mixed_graphs
        self.graphs = self.mixed_graphs = None
        try:
            yield
        finally:
            self.graphs, self.mixed_graphs = kept

    def _issue(self, orders: SwapOrders, defer_out: bool = False) -> None:
        """The step's copies: chunks leaving the tiers kept for the disk first (their slots
        and blocks may be reused now; the removals that make room for them before them; a slot
        saved earlier and not yet copied is copied before this step's copies write it), chunks
        read from disk loaded into their blocks last."""
        if self.disk is not None:
            self.disk.drop(orders.disk_drop)
            self.disk.save(orders.disk_save)
            overwritten = (*orders.swap_out, *orders.evict_first)
            self.disk.before_overwrite({op.cpu_slot for op in overwritten})
        self.swap.issue(orders, defer_out=defer_out)
        if self.disk is not None:
            self.disk.load(orders.disk_load)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: of every rank's share, under tensor parallelism."""
        return self.swap.block_bytes * self._num_ranks

    def settle(self) -> None:
        self.swap.settle()
        self.tracer.reset()
        self.swap_tracer.reset()

    def swap_stats(self, wait: bool = True) -> SwapStats:
        """The swap totals, with the copies done so far timed (`wait`: every copy issued); the
        copies done are traced too, while tracing is on."""
        stats = self._every_rank(self.swap.collect_stats(wait=wait))
        self.swap_tracer.collect()
        return stats

    def swap_totals(self) -> SwapStats:
        """The swap totals as last collected (`swap_stats`), without collecting."""
        return self._every_rank(self.swap.stats)

    @property
    def _num_ranks(self) -> int:
        return 1 if self.shard is None else self.shard.world_size

    def _every_rank(self, stats: SwapStats) -> SwapStats:
        # every rank moves its share of the same blocks at the same time: bytes add up, the
        # seconds do not
        n = self._num_ranks
        return dataclasses.replace(
            stats, bytes_in=stats.bytes_in * n, bytes_out=stats.bytes_out * n
        )

    def device_time(self) -> DeviceTime:
        return self.clock.read() if self.clock is not None else DeviceTime()

    def execute(self, plan: StepPlan) -> list[int]:
        """Run the plan; returns one sampled token per piece that samples, in plan order."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, feed: Launch | None = None) -> Launched:
        """Issue the plan's copies and forward. With greedy sampling the step may still be
        running when this returns: the host can work (or launch the next step) meanwhile.

        `feed`: the step issued just before, which samples the tokens this plan's PLACEHOLDER
        positions stand for. While tracing is on, a plan with trace contexts (`plan.traces`)
        has its requests' phases traced (`StepTracer`) and its copies (`SwapTracer`), and a
        step that moves KV is a span."""
        if feed is not None and not isinstance(feed, Launched):
            raise TypeError("a ModelRunner is fed only by its own launches")
        if not tracing.enabled():
            return self._launch(plan, feed)
        step = self.tracer.launched(plan, plan.traces) if plan.traces is not None else None
        orders = plan.orders
        if orders.swap_in or orders.swap_out or orders.evict_first:
            # not in any turn's trace: it serves many
            with tracing.tracer("executor").start_as_current_span("step") as span:
                span.set_attributes(
                    {
                        "pensieve.swap_in_blocks": len(orders.swap_in),
                        "pensieve.swap_out_blocks": len(orders.swap_out),
                        "pensieve.evict_first_blocks": len(orders.evict_first),
                        "pensieve.sequences": len(plan.pieces),
                        "pensieve.tokens": plan.num_tokens,
                    }
                )
                launched = self._launch(plan, feed)
        else:
            launched = self._launch(plan, feed)
        if step is not None:
            launched.tracer, launched.trace_step = self.tracer, step
        self.swap_tracer.issued(plan.copy_traces, self.swap.windows)
        launched.swaps = self.swap_tracer
        return launched

    def _launch(self, plan: StepPlan, feed: Launched | None) -> Launched:
        if self.grammars is not None:
            self.grammars.forget_absent(plan.pieces)
        self.penalties.forget_absent(plan.pieces)
        if not plan.pieces:
            self._issue(plan.orders)
            empty = torch.empty(0, dtype=torch.long)
            return Launched(plan, empty, empty, None)
        ordered = decodes_first(plan)  # the order the device runs; results keep `plan`'s
        executed = None if ordered is plan else ordered
        began = self.clock.start() if self.clock is not None else None
        if self.graphs is not None and self.graphs.fits(ordered):
            self._issue(ordered.orders, defer_out=True)
            logits = self._replay(self.graphs, ordered, feed)
        else:
            # the step's inputs go up first: behind the swap-ins they would share the
            # host-to-device copy queue with them and hold back the first layer
            inputs = self._inputs(ordered, feed)
            self._issue(ordered.orders, defer_out=True)
            logits = self._forward(inputs)
        sampling = [p for p in ordered.pieces if p.sampling is not None]
        params = [p.sampling for p in sampling]
        constrained = self._constrain(logits, sampling)  # while the forward runs
        penalized = self.penalties.apply(logits, sampling)
        tokens = sample_async(logits, params, [p.sample_index for p in sampling])  # type: ignore[arg-type]
        if self.shard is not None and not all(p.greedy for p in params):  # type: ignore[union-attr]
            # every rank holds the same logits, but an unseeded draw differs by rank: all take
            # rank 0's, so the KV each writes next step is of the same tokens
            broadcast_from_first(tokens, self.shard)
        self.penalties.sampled(tokens, sampling, penalized)
        self.swap.issue_out()  # while the device runs the forward
        if tokens.device.type != "cuda":
            launched = Launched(plan, tokens, tokens, None, executed)
        else:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            if self.clock is not None and began is not None:
                self.clock.end(began, continues=feed is not None)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            launched = Launched(plan, tokens, host, ready, executed)
        if constrained:
            self.grammars.sampled(launched, sampling)  # type: ignore[union-attr]
        return launched

    def _constrain(self, logits: torch.Tensor, sampling: list[SeqPiece]) -> bool:
        """Mask the logits [sampling pieces, V] of constrained requests to what their grammars
        allow next; False if none is constrained."""
        if all(p.sampling.grammar is None for p in sampling):  # type: ignore[union-attr]
            return False
        if self.grammars is None:
            raise ValueError("a constrained request, but this executor has no grammars")
        self.swap.issue_out()  # before waiting for the tokens of the steps before
        found = self.grammars.masks(sampling)
        if found is None:
            return False
        rows, bitmask = found
        device = logits.device
        rows_t = upload(torch.tensor(rows, dtype=torch.long), device)
        apply_token_mask(logits, rows_t, bitmask.to(device, non_blocking=True))
        return True

    @torch.inference_mode()
    def logits(self, plan: StepPlan, feed: Launched | None = None) -> torch.Tensor:
        """Logits [pieces that sample, vocab] of the plan's forward (swaps already issued), rows
        in plan order: a tensor of the caller's (a graph's logits buffer serves every replay)."""
        if self.graphs is not None and self.graphs.fits(plan):
            return self._replay(self.graphs, plan, feed).clone()
        return self._forward(self._inputs(plan, feed))

    def _replay(self, graphs: DecodeGraphs, plan: StepPlan, feed: Launched | None) -> torch.Tensor:
        """A pure-decode plan's logits from its CUDA graph (`graphs.fits(plan)`)."""
        self.swap.wait_all()
        return graphs.logits(plan, lambda ids: self._feed(ids, plan.pieces, feed))

    def _inputs(self, plan: StepPlan, feed: Launched | None) -> _Inputs:
        """An eager forward's inputs, on the device."""
        # single-token pieces (decodes) first: attention then runs them on decode tiles
        order = sorted(
            range(len(plan.pieces)), key=lambda i: plan.pieces[i].end - plan.pieces[i].start > 1
        )
        pieces = [plan.pieces[i] for i in order]
        token_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # plan index of a sampling piece -> its last token's row
        for i, piece in zip(order, pieces, strict=True):
            token_ids += piece.token_ids
            positions += range(piece.start, piece.end)
            if piece.sampling is not None:
                last_row[i] = len(token_ids) - 1
        meta = build_metadata(
            [p.end - p.start for p in pieces],
            [p.end for p in pieces],
            [p.block_table for p in pieces],
            self.cache.block_size,
            self.device,
        )
        rows = [last_row[i] for i in sorted(last_row)]
        ids, pos = upload(torch.tensor([token_ids, positions], dtype=torch.long), self.device)
        self._feed(ids, pieces, feed)
        rows_t = torch.tensor(rows, dtype=torch.long)  # a step may sample nothing: a prefill chunk
        return _Inputs(meta, ids, pos, upload(rows_t, self.device))

    def _forward(self, inputs: _Inputs) -> torch.Tensor:
        attn = PagedAttention(
            self.gpu_caches,
            inputs.meta,
            self.scale,
            impl=self.impl,
            before_layer=self.swap.wait_layer if self.swap.pipelined else None,
        )
        if self.mixed_graphs is not None and self.mixed_graphs.fits(inputs.ids.shape[0]):
            hidden = self.mixed_graphs.forward(inputs.ids, inputs.positions, attn)
        else:
            hidden = self.model(inputs.ids, inputs.positions, attn)  # [T, hidden]
        return self.model.compute_logits(hidden[inputs.rows])

    def _feed(
        self,
        ids: torch.Tensor,
        pieces: list[SeqPiece] | tuple[SeqPiece, ...],
        feed: Launched | None,
    ) -> None:
        """Put the tokens `feed` samples into the rows of `ids` (one per single-token piece, in
        order, then the rest) that hold a PLACEHOLDER."""
        into: list[int] = []
        take: list[int] = []
        row = 0
        for piece in pieces:
            if piece.token_ids[-1] == PLACEHOLDER:
                if feed is None or piece.end - piece.start != 1:
                    raise ValueError(f"{piece.request_id}: a placeholder with nothing to feed it")
                into.append(row)
                take.append(feed.rows[piece.request_id])
            row += piece.end - piece.start
        if into:
            where = upload(torch.tensor([into, take], dtype=torch.long), ids.device)
            ids[where[0]] = feed.tokens[where[1]]  # type: ignore[union-attr]
