"""Multi-turn ShareGPT workloads and the drivers that replay them.

A workload is a list of `ConvSpec`s; each turn is two runs of token ids:

    prompt of turn k = user_0 + reply_0 + user_1 + reply_1 + ... + user_k
    user_k  = the chat template's text between reply k-1 and reply k: the end of the previous
              assistant message, the user message, the opening of the assistant's answer
    reply_k = the recorded reply's ids, capped at `max_output`; their count is the turn's output
              length (EOS is ignored, so every system generates exactly that many tokens)

`History.RECORDED` puts the recorded reply ids into the next prompt, so two systems whose random
weights generate different tokens still see identical prompts (ours against transformers).
`History.GENERATED` puts in what the engine generated, as a chat client would, which lets the
engine's cache reuse the whole history; the token counts are the same either way.

Drivers, all bounded in time:
  steady_closed_loop     K conversations always in flight: a conversation's next turn is sent
                         when its reply ends, and when it has none the next one of the pool starts;
                         output tokens are counted as generated in a window after a warm-up.
  hf_steady_closed_loop  the same against a transformers continuous-batching manager.
  open_loop       real time: conversations arrive as a Poisson process, each next turn is sent an
                  exponential think time after the previous reply.
"""

from __future__ import annotations

import enum
import gc
import heapq
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.request import FinishReason, Request, TokenSources
from pensieve.actors.scheduler.step_timing import StepTiming
from pensieve.actors.wire.step import SamplingParams
from pensieve.kernels.compile_log import CompileLog
from pensieve.ops.sharegpt import Conversation, Role, human_turns

_REPLY_MARK = "\u27e6pensieve-reply-{}\u27e7"  # stands in for reply k while the template renders
_REPLY_SPLIT = re.compile("\u27e6pensieve-reply-\\d+\u27e7")


class History(enum.Enum):
    RECORDED = "recorded"
    GENERATED = "generated"


@dataclass(frozen=True)
class Turn:
    user_ids: tuple[int, ...]
    reply_ids: tuple[int, ...]  # never empty

    @property
    def num_output(self) -> int:
        return len(self.reply_ids)


@dataclass(frozen=True)
class ConvSpec:
    conv_id: str
    turns: tuple[Turn, ...]

    @property
    def num_output(self) -> int:
        return sum(turn.num_output for turn in self.turns)


def build_workload(
    conversations: Iterable[Conversation],
    tokenizer: Any,
    vocab_size: int,
    max_output: int,
    max_context: int,
    max_turns: int | None = None,
) -> list[ConvSpec]:
    """Tokenize conversations into turns; a conversation ends at its first turn without a
    recorded reply or whose prompt plus reply would not fit in `max_context` tokens."""
    specs = []
    for conv in conversations:
        turns = _turns(conv, tokenizer, vocab_size, max_output, max_context, max_turns)
        if turns:
            specs.append(ConvSpec(conv.id, tuple(turns)))
    return specs


def _turns(
    conv: Conversation,
    tokenizer: Any,
    vocab_size: int,
    max_output: int,
    max_context: int,
    max_turns: int | None,
) -> list[Turn]:
    human = list(human_turns(conv))[:max_turns]
    cut = next((i for i, t in enumerate(human) if not t.reply), len(human))
    human = human[:cut]
    if not human:
        return []
    messages = [
        {"role": "system", "content": m.text} for m in conv.turns[:1] if m.role is Role.SYSTEM
    ]
    for k, turn in enumerate(human):
        messages.append({"role": "user", "content": turn.text})
        if k + 1 < len(human):
            messages.append({"role": "assistant", "content": _REPLY_MARK.format(k)})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = _REPLY_SPLIT.split(text)
    if len(pieces) != len(human):
        return []  # a template that rewrites message contents: no clean split
    turns: list[Turn] = []
    context = 0
    for piece, turn in zip(pieces, human, strict=True):
        user = _encode(tokenizer, piece, vocab_size)
        reply = _encode(tokenizer, turn.reply or "", vocab_size)[:max_output]
        context += len(user) + len(reply)
        if not reply or not user or context > max_context:
            break
        turns.append(Turn(tuple(user), tuple(reply)))
    return turns


def _encode(tokenizer: Any, text: str, vocab_size: int) -> list[int]:
    # presets with a smaller vocabulary than the tokenizer see ids folded into theirs
    return [int(t) % vocab_size for t in tokenizer.encode(text, add_special_tokens=False)]


# ---- per-turn records and their summary ------------------------------------------------------


@dataclass
class TurnRecord:
    """One turn; times in seconds since the run's start. `finished` None: not done in time."""

    conv_id: str
    turn: int
    due: float  # when the user sent it
    prompt_tokens: int
    output_tokens: int
    first_token: float | None = None
    finished: float | None = None
    sources: TokenSources = TokenSources()
    suspensions: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.finished is not None and self.error is None

    @property
    def latency(self) -> float:
        return self.finished - self.due if self.ok else math.inf  # type: ignore[operator]

    @property
    def normalized_latency(self) -> float:
        return self.latency / max(self.output_tokens, 1)

    @property
    def ttft(self) -> float:
        return self.first_token - self.due if self.ok and self.first_token else math.inf


@dataclass
class LoopResult:
    records: list[TurnRecord]
    seconds: float  # from the start to the last reply (closed loop) or the end of the drain
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def finished(self) -> list[TurnRecord]:
        return [r for r in self.records if r.ok]

    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.finished())


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); inf values count as the slowest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if math.isinf(ordered[hi]) or lo == hi:
        return ordered[hi] if math.isinf(ordered[hi]) else ordered[lo]
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: Sequence[TurnRecord], seconds: float) -> dict[str, Any]:
    """Throughput over `seconds`, latency percentiles (unfinished turns count as infinitely
    slow) and where the prompt tokens of the finished turns came from."""
    done = [r for r in records if r.ok]
    sources = sum((r.sources for r in done), TokenSources())
    norm = [r.normalized_latency for r in records]
    ttft = [r.ttft for r in records]
    return {
        "turns": len(records),
        "finished": len(done),
        "output_tokens": sum(r.output_tokens for r in done),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "seconds": seconds,
        "req_per_s": len(done) / seconds if seconds > 0 else math.nan,
        "tok_per_s": sum(r.output_tokens for r in done) / seconds if seconds > 0 else math.nan,
        "norm_latency_p50": percentile(norm, 50),
        "norm_latency_p90": percentile(norm, 90),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "sources": {
            "gpu": sources.gpu,
            "cpu": sources.cpu,
            "recomputed": sources.recomputed,
            "new": sources.new,
        },
        "suspensions": sum(r.suspensions for r in records),
        "errors": sorted({r.error for r in records if r.error})[:3],
    }


# ---- the drivers ---------------------------------------------------------------------------


class _Chat:
    """A conversation being driven: its spec, its next turn and the history sent so far."""

    def __init__(self, spec: ConvSpec, conv_id: str, history: History) -> None:
        self.spec = spec
        self.conv_id = conv_id
        self.mode = history
        self.next = 0
        self.history: list[int] = []
        self.thinks: list[float] = []  # open loop: think time before each turn after the first

    @property
    def has_next(self) -> bool:
        return self.next < len(self.spec.turns)

    @property
    def turn(self) -> Turn:
        return self.spec.turns[self.next]

    def prompt(self) -> list[int]:
        return self.history + list(self.turn.user_ids)

    def advance(self, prompt: list[int], output_ids: Sequence[int]) -> None:
        reply = output_ids if self.mode is History.GENERATED else self.turn.reply_ids
        self.history = prompt + list(reply)
        self.next += 1


def _sampling(turn: Turn) -> SamplingParams:
    return SamplingParams(max_tokens=turn.num_output, ignore_eos=True)


def _record(
    chat: _Chat, due: float, prompt: list[int], request: Request, start: float
) -> TurnRecord:
    failed = request.finish_reason is FinishReason.ABORT
    return TurnRecord(
        conv_id=chat.conv_id,
        turn=chat.next,
        due=due,
        prompt_tokens=len(prompt),
        output_tokens=len(request.output_ids),
        first_token=None if request.first_token_time is None else request.first_token_time - start,
        finished=None if request.finish_time is None else request.finish_time - start,
        sources=request.sources,
        suspensions=request.num_suspensions,
        error=(request.error or "aborted") if failed else None,
    )


@dataclass
class Window:
    """What happens in [begin, end) seconds of a run: output tokens counted as they are generated
    (a turn still running at `end` counts the tokens it had by then), turns that finish, and the
    time-averaged number of turns in flight (sent, not finished) and decoding (first token out,
    not finished). Feed it events in time order."""

    begin: float
    end: float
    tokens: int = 0
    turns_finished: int = 0
    in_flight: int = 0
    decoding: int = 0
    now: float = 0.0
    _in_flight_area: float = 0.0
    _decoding_area: float = 0.0

    def at(self, t: float) -> None:
        lo, hi = max(self.now, self.begin), min(t, self.end)
        if hi > lo:
            self._in_flight_area += self.in_flight * (hi - lo)
            self._decoding_area += self.decoding * (hi - lo)
        self.now = max(self.now, t)

    def inside(self, t: float) -> bool:
        return self.begin <= t < self.end

    def sent(self, t: float) -> None:
        self.at(t)
        self.in_flight += 1

    def generated(self, t: float, n: int, started: int) -> None:
        """`n` tokens at `t`, the first ones of `started` turns."""
        self.at(t)
        self.decoding += started
        self.tokens += n if self.inside(t) else 0

    def done(self, t: float, decoded: bool) -> None:
        self.at(t)
        self.in_flight -= 1
        self.decoding -= int(decoded)
        self.turns_finished += int(self.inside(t))

    @property
    def seconds(self) -> float:
        """The part of the window the run covered (all of it unless it stopped early)."""
        return max(0.0, min(self.now, self.end) - self.begin)

    def summary(self) -> dict[str, Any]:
        seconds = self.seconds

        def per_s(x: float) -> float:
            return x / seconds if seconds > 0 else math.nan

        return {
            "warmup_s": self.begin,
            "seconds": seconds,
            "tokens": self.tokens,
            "tok_per_s": per_s(self.tokens),
            "turns_finished": self.turns_finished,
            "mean_in_flight": per_s(self._in_flight_area),
            "mean_decoding": per_s(self._decoding_area),
        }


@dataclass
class SteadyResult:
    """A steady-state closed loop: its window, every turn that finished (whenever it did), how
    many conversations were started and how many times the pool was run through."""

    window: Window
    records: list[TurnRecord]
    conversations_started: int
    laps: int
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "window": self.window.summary(),
            "turns_finished": len(self.records),
            "conversations_started": self.conversations_started,
            "pool_laps": self.laps,
            "errors": sorted({r.error for r in self.records if r.error})[:3],
            # (conversation, turn, prompt tokens, output tokens) of every finished turn
            "turn_tokens": [
                [r.conv_id, r.turn, r.prompt_tokens, r.output_tokens] for r in self.records
            ],
            **self.extra,
        }


class _Pool:
    """Conversations in order; once all were started it starts them over under new ids."""

    def __init__(self, specs: Sequence[ConvSpec], history: History) -> None:
        if not specs:
            raise ValueError("an empty pool of conversations")
        self.specs = specs
        self.history = history
        self.started = 0

    @property
    def laps(self) -> int:
        return -(-self.started // len(self.specs))

    def next(self) -> _Chat:
        lap, i = divmod(self.started, len(self.specs))
        spec = self.specs[i]
        self.started += 1
        return _Chat(spec, spec.conv_id if lap == 0 else f"{spec.conv_id}@{lap}", self.history)


def steady_closed_loop(
    engine: Engine,
    specs: Sequence[ConvSpec],
    concurrency: int,
    warmup_s: float,
    window_s: float,
    history: History = History.RECORDED,
) -> SteadyResult:
    """Keep `concurrency` conversations in flight (a conversation's next turn is sent when its
    reply ends; when it has none, the next conversation of the pool starts) until `warmup_s +
    window_s`, counting the tokens each step samples in the window [warmup_s, warmup_s +
    window_s) of the engine's clock."""
    pool = _Pool(specs, history)
    window = Window(warmup_s, warmup_s + window_s)
    active: dict[str, tuple[_Chat, float, list[int]]] = {}  # request id -> chat, sent, prompt
    decoding: set[str] = set()
    records: list[TurnRecord] = []
    steps = step_tokens = 0
    start = engine.clock()

    def submit(chat: _Chat) -> None:
        prompt = chat.prompt()
        request = engine.add_request(chat.conv_id, prompt, _sampling(chat.turn))
        now = engine.clock() - start
        active[request.request_id] = (chat, now, prompt)
        window.sent(now)

    for _ in range(concurrency):
        submit(pool.next())
    now = 0.0
    while now < window.end:
        outcome = engine.step()
        now = engine.clock() - start
        if window.inside(now):
            steps += 1
            step_tokens += len(outcome.new_tokens)
        started = outcome.new_tokens.keys() - decoding
        decoding |= started
        window.generated(now, len(outcome.new_tokens), len(started))
        for request in outcome.finished:
            chat, sent, prompt = active.pop(request.request_id)
            window.done(now, request.request_id in decoding)
            decoding.discard(request.request_id)
            records.append(_record(chat, sent, prompt, request, start))
            chat.advance(prompt, request.output_ids)
            submit(chat if chat.has_next else pool.next())
    window.at(now)
    extra = {"steps_in_window": steps, "tokens_per_step": step_tokens / max(steps, 1)}
    return SteadyResult(window, records, pool.started, pool.laps, extra)


def hf_steady_closed_loop(
    manager: Any,
    specs: Sequence[ConvSpec],
    concurrency: int,
    warmup_s: float,
    window_s: float,
    streaming: bool = True,
    poll_s: float = 1.0,
) -> SteadyResult:
    """`steady_closed_loop` against a started transformers ContinuousBatchingManager (recorded
    history). With `streaming` each request reports its tokens as they arrive and they are
    counted then; without it a request's tokens all count when it finishes.

    Raises if the manager's generation thread dies; every wait is bounded by `poll_s`.
    """
    pool = _Pool(specs, History.RECORDED)
    window = Window(warmup_s, warmup_s + window_s)
    active: dict[str, tuple[_Chat, float, list[int]]] = {}
    seen: dict[str, int] = {}  # request id -> tokens counted so far
    records: list[TurnRecord] = []
    first_token: dict[str, float] = {}
    start = time.perf_counter()

    def submit(chat: _Chat) -> None:
        prompt = chat.prompt()
        request_id = f"{chat.conv_id}#{chat.next}"
        accepted = manager.add_request(
            input_ids=prompt,
            request_id=request_id,
            max_new_tokens=chat.turn.num_output,
            eos_token_id=-1,
            **({"streaming": True} if streaming else {}),
        )
        if accepted is None:
            raise RuntimeError("the transformers manager refused a request")
        now = time.perf_counter() - start
        active[request_id] = (chat, now, prompt)
        seen[request_id] = 0
        window.sent(now)

    for _ in range(concurrency):
        submit(pool.next())
    now = 0.0
    while now < window.end:
        result = manager.get_result(timeout=max(0.01, min(poll_s, window.end - now)))
        now = time.perf_counter() - start
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the transformers generation thread stopped")
            continue
        request_id = result.request_id
        if request_id not in active:
            continue
        finished = result.is_finished()
        count = len(result.generated_tokens)
        if (streaming or finished) and count > seen[request_id]:
            window.generated(now, count - seen[request_id], int(seen[request_id] == 0))
            first_token.setdefault(request_id, now)
            seen[request_id] = count
        if not finished:
            continue
        chat, sent, prompt = active.pop(request_id)
        window.done(now, seen.pop(request_id) > 0)
        records.append(
            TurnRecord(
                chat.conv_id,
                chat.next,
                sent,
                len(prompt),
                count,
                first_token.pop(request_id, None),
                now,
                error=result.error,
            )
        )
        chat.advance(prompt, ())
        submit(chat if chat.has_next else pool.next())
    window.at(now)
    extra = {"counting": "streamed tokens" if streaming else "finished requests only"}
    return SteadyResult(window, records, pool.started, pool.laps, extra)


@dataclass(frozen=True)
class OpenLoop:
    conv_rate: float  # new conversations per second (Poisson)
    think_s: float  # mean think time between a reply and the next turn (exponential)
    duration_s: float  # conversations arrive and turns are sent only before this
    warmup_s: float = 0.0  # turns sent before this are served but not measured
    drain_s: float = 30.0  # then in-flight turns get this long; later ones count as unfinished
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conv_rate <= 0 or self.think_s < 0 or not 0 <= self.warmup_s < self.duration_s:
            raise ValueError("need conv_rate > 0, think_s >= 0 and 0 <= warmup_s < duration_s")


def arrivals(
    specs: Sequence[ConvSpec], options: OpenLoop, history: History
) -> list[tuple[float, _Chat]]:
    """The run's conversations with their arrival times and think times, drawn only from the
    seed, so every policy sees the same workload. Specs are reused (under new ids) if needed."""
    rng = random.Random(options.seed)
    out: list[tuple[float, _Chat]] = []
    t = rng.expovariate(options.conv_rate)
    while t < options.duration_s:
        n = len(out)
        spec = specs[n % len(specs)]
        chat = _Chat(spec, f"{spec.conv_id}@{n}", history)
        chat.thinks = [
            rng.expovariate(1.0 / options.think_s) if options.think_s > 0 else 0.0
            for _ in spec.turns
        ]
        out.append((t, chat))
        t += rng.expovariate(options.conv_rate)
    return out


def open_loop(
    engine: Engine,
    specs: Sequence[ConvSpec],
    options: OpenLoop,
    history: History = History.GENERATED,
    sleep: Callable[[float], None] = time.sleep,
    on_step: Callable[[float], None] | None = None,
) -> LoopResult:
    """Drive the engine in real time (its own clock; `sleep` must advance that clock): send due
    turns, step while there is work, else sleep until the next turn is due. Only turns sent in
    [warmup_s, duration_s) are returned. `on_step(now)` runs before every step (a profiler's
    window). The result's `extra` has the step times, for the steps of the measured window
    where their time went (`step_breakdown`), the garbage collector's pauses (`gc`), the Triton
    kernels compiled meanwhile (`compiles`) and what each slow step did (`slow`)."""
    began = time.perf_counter()
    with GcPauses() as pauses, CompileLog() as compiled:
        result = _open_loop(engine, specs, options, history, sleep, on_step)
    result.extra["gc"] = pauses.summary()
    result.extra["compiles"] = [
        {"kernel": e.kernel, "at_s": e.start_s - began, "ms": e.seconds * 1e3, "detail": e.detail}
        for e in compiled.events
    ]
    return result


class GcPauses:
    """Python's garbage-collector pauses while entered: a full collection walks every tracked
    object and stops the step loop meanwhile (see `pensieve.ops.factory.frozen_heap`)."""

    def __init__(self) -> None:
        self.seconds: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._began = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds[info["generation"]].append(time.perf_counter() - self._began)

    def summary(self) -> dict[str, Any]:
        every = [t for times in self.seconds.values() for t in times]
        return {
            "collections": [len(self.seconds[g]) for g in (0, 1, 2)],  # by generation
            "seconds": sum(every),
            "full_max_ms": max(self.seconds[2], default=0.0) * 1e3,
        }


def _open_loop(
    engine: Engine,
    specs: Sequence[ConvSpec],
    options: OpenLoop,
    history: History,
    sleep: Callable[[float], None],
    on_step: Callable[[float], None] | None,
) -> LoopResult:
    due_heap = [(t, i, chat) for i, (t, chat) in enumerate(arrivals(specs, options, history))]
    heapq.heapify(due_heap)
    seq = len(due_heap)
    active: dict[str, tuple[_Chat, float, list[int]]] = {}
    records: list[TurnRecord] = []
    step_seconds: list[float] = []
    timings: list[StepTiming] = []
    slow: list[dict[str, Any]] = []
    start = engine.clock()
    end = options.duration_s + options.drain_s
    while True:
        now = engine.clock() - start
        if now > end or not (due_heap or active):
            break
        while due_heap and due_heap[0][0] <= now:
            due, _, chat = heapq.heappop(due_heap)
            prompt = chat.prompt()
            engine.add_request(chat.conv_id, prompt, _sampling(chat.turn))
            active[chat.conv_id] = (chat, due, prompt)
        if engine.has_work():
            if on_step is not None:
                on_step(now)
            begin = engine.clock()
            outcome = engine.step()
            step_seconds.append(engine.clock() - begin)
            if step_seconds[-1] >= SLOW_STEP_S:
                slow.append(_slow_step(now, step_seconds[-1], engine.last_timing))
            if options.warmup_s <= now < options.duration_s and engine.last_timing is not None:
                timings.append(engine.last_timing)
            for request in outcome.finished:
                chat, due, prompt = active.pop(request.conv_id)
                records.append(_record(chat, due, prompt, request, start))
                chat.advance(prompt, request.output_ids)
                finish = (request.finish_time or engine.clock()) - start
                if chat.has_next and finish + chat.thinks[chat.next] < options.duration_s:
                    heapq.heappush(due_heap, (finish + chat.thinks[chat.next], seq, chat))
                    seq += 1
        elif due_heap:
            sleep(max(0.0, min(due_heap[0][0], end) - (engine.clock() - start)))
    for chat, due, prompt in active.values():
        records.append(TurnRecord(chat.conv_id, chat.next, due, len(prompt), chat.turn.num_output))
    measured = [r for r in records if options.warmup_s <= r.due < options.duration_s]
    extra = step_times(step_seconds)
    extra["step_breakdown"] = step_breakdown(timings, options.duration_s - options.warmup_s)
    extra["slow"] = slow
    return LoopResult(measured, engine.clock() - start, timed_out=bool(active), extra=extra)


SLOW_STEP_S = 0.5  # a step this long stalls every running request (e.g. a kernel compiled mid-run)


def _slow_step(at_s: float, seconds: float, timing: StepTiming | None) -> dict[str, Any]:
    """A slow step: when (seconds into the loop), how long, and where its time went."""
    out: dict[str, Any] = {"at_s": at_s, "ms": seconds * 1e3}
    if timing is not None:
        out["kind"] = timing.kind
        for name, value in asdict(timing).items():
            if name.endswith("_s"):
                out[name[:-2] + "_ms"] = value * 1e3
            else:
                out[name] = value
    return out


def step_breakdown(timings: Sequence[StepTiming], window_s: float) -> dict[str, Any]:
    """Where a window's wall time went: per kind of step (`StepTiming.kind`) its count, seconds,
    mean ms and mean decodes / prefill tokens / swapped-in blocks, and over all steps the host
    phases of `StepTiming` (the wait for the device is what the host could not fill)."""
    kinds: dict[str, list[StepTiming]] = {}
    for t in timings:
        kinds.setdefault(t.kind, []).append(t)
    out: dict[str, Any] = {"window_s": window_s, "steps": len(timings)}
    for kind, group in sorted(kinds.items()):
        seconds = sum(t.total_s for t in group)
        n = len(group)
        out[kind] = {
            "steps": n,
            "seconds": seconds,
            "ms_mean": 1e3 * seconds / n,
            "decodes_mean": sum(t.decodes for t in group) / n,
            # mean KV positions a decode attends to (with the decodes, the KV a step reads)
            "decode_context_mean": sum(t.decode_positions for t in group)
            / max(1, sum(t.decodes for t in group)),
            "prefill_tokens_mean": sum(t.prefill_tokens for t in group) / n,
            "swap_in_blocks_mean": sum(t.swap_in for t in group) / n,
            "swap_out_blocks_mean": sum(t.swap_out for t in group) / n,
            "wait_ms_mean": 1e3 * sum(t.wait_s for t in group) / n,
        }
    for phase in PHASES:
        out[phase] = sum(getattr(t, phase) for t in timings)
    out["idle_s"] = max(0.0, window_s - sum(out[phase] for phase in PHASES))
    return out


PHASES = ("schedule_s", "launch_s", "ahead_s", "wait_s", "update_s")


def describe_breakdown(b: dict[str, Any]) -> str:
    """One line of `step_breakdown`."""
    parts = [
        f"{kind} {v['steps']}x{v['ms_mean']:.1f}ms ({v['decodes_mean']:.0f}d"
        f"@{v['decode_context_mean']:.0f}+"
        f"{v['prefill_tokens_mean']:.0f}p, in {v['swap_in_blocks_mean']:.0f} out "
        f"{v['swap_out_blocks_mean']:.0f}, wait {v['wait_ms_mean']:.1f}ms)"
        for kind, v in b.items()
        if isinstance(v, dict)
    ]
    phases = ", ".join(f"{phase[:-2]} {b[phase]:.1f}s" for phase in (*PHASES, "idle_s"))
    parts.append(f"{phases} of {b['window_s']:.0f}s")
    return "; ".join(parts)


def describe_slow_step(step: dict[str, Any]) -> str:
    """One line for a `_slow_step` record."""
    text = f"{step['ms']:.0f} ms"
    if "kind" not in step:
        return text
    phases = ", ".join(f"{p[:-2]} {step[p[:-2] + '_ms']:.0f}" for p in PHASES)
    return (
        f"{text} ({step['kind']}: {step['decodes']}d+{step['prefill_tokens']}p, in "
        f"{step['swap_in']} out {step['swap_out']} first {step['evict_first']}; ms: {phases})"
    )


def step_times(seconds: Sequence[float]) -> dict[str, Any]:
    """Step durations of a run in ms: median, p99, the longest, and how many were slow."""
    ms = [t * 1e3 for t in seconds] or [0.0]
    return {
        "step_ms_p50": percentile(ms, 50),
        "step_ms_p99": percentile(ms, 99),
        "step_ms_max": max(ms),
        "slow_steps": sum(1 for t in seconds if t >= SLOW_STEP_S),
    }
