"""What a run of agentic sessions (`ops/agentic_load.py`) measured, and its summary: latency
and throughput, goodput under the objective, where the prompt tokens came from, and:

- reuse: a later turn may take from the cache the previous turn's prompt, and its reply where
  the client sends the server's own back; the share of that served from the GPU or CPU tier
  (a server that reuses by content serves nearly all of it, recorded replies or not);
- the long prompt: its time to first token, and the sessions' inter-token gaps that ended
  while it waited for its first token (its prefill) against the others.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import msgspec

from pensieve.actors.wire.replies import PromptSources
from pensieve.ops.load_report import Report, Request, serving_metrics

REPORT = Report()  # `vllm bench serve`'s defaults
SHARES = ("gpu", "cpu", "disk", "recomputed", "new")  # the sources that add up to a prompt


@dataclass(frozen=True)
class Slo:
    """The objective a turn meets to count in the goodput."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("the service objectives must be positive")


@dataclass(frozen=True)
class TurnResult:
    session: str
    index: int  # counts from 0 within the session
    ttft_s: float
    latency_s: float
    arrived: tuple[float, ...]  # each streamed chunk, perf_counter seconds
    prompt_tokens: int
    completion_tokens: int
    sources: dict[str, int]  # its reply's `prompt_sources`
    allowed: int | None  # prompt tokens the workload lets come from the cache (None: turn 0)
    # the reply's tokens shown with each chunk (the server's `completion_tokens`; empty or 0
    # where it does not say)
    shown: tuple[int, ...] = ()

    @property
    def gaps_s(self) -> list[float]:
        """Between streamed chunks."""
        return [b - a for a, b in pairwise(self.arrived)]

    def token_gaps(self) -> list[tuple[float, float]]:
        """Between tokens: a chunk that shows k tokens after a gap g counts k gaps of g / k (a
        character of several tokens shows when it is whole, so one chunk may carry many), each
        as (gap, when its chunk came); none where the server does not count them."""
        if len(self.shown) != len(self.arrived) or not any(self.shown):
            return []
        found = []
        for (a, n), (b, m) in pairwise(zip(self.arrived, self.shown, strict=True)):
            found += [((b - a) / (m - n), b)] * (m - n) if m > n else []
        return found

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with one token)."""
        if self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)

    def meets(self, slo: Slo) -> bool:
        tpot = self.tpot_s
        return self.ttft_s <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


@dataclass
class Outcome:
    """What a run's sessions did: each finished turn, and how sessions ended."""

    turns: list[TurnResult] = field(default_factory=list)
    started: int = 0
    completed: set[str] = field(default_factory=set)
    session_s: list[float] = field(default_factory=list)  # each completed session, end to end
    errors: Counter[str] = field(default_factory=Counter)
    long_prompt: LongPromptResult | None = None


@dataclass(frozen=True)
class LongPromptResult:
    """The long prompt's request, in perf_counter seconds."""

    at_s: float  # sent, from the run's start
    sent: float
    first: float | None  # its first token (None: none came)
    done: float
    prompt_tokens: int | None
    error: str | None


def stats(values: list[float]) -> dict[str, float] | None:
    """Mean, median, p90 and p99 (None: no values)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(
    outcome: Outcome, seconds: float, slo: Slo, report: Report = REPORT
) -> dict[str, Any]:
    turns = outcome.turns
    prompt = sum(t.prompt_tokens for t in turns)
    output = sum(t.completion_tokens for t in turns)
    sources = PromptSources.total([t.sources for t in turns])
    by_source = msgspec.structs.asdict(sources)
    missed = {t.session for t in turns if not t.meets(slo)}
    good_sessions = len(outcome.completed - missed)
    good_turns = sum(t.meets(slo) for t in turns)

    def per_s(n: float) -> float:
        return n / seconds if seconds > 0 else 0.0

    return {
        "sessions": outcome.started,
        "sessions_completed": len(outcome.completed),
        "turns": len(turns),
        "errors": dict(outcome.errors),
        "seconds": seconds,
        "turns_per_s": per_s(len(turns)),
        "output_tokens": output,
        "output_tok_per_s": per_s(output),
        "prompt_tokens": prompt,
        "input_tok_per_s": per_s(prompt),
        "cached_tokens": sources.cached,
        "prompt_sources": by_source,
        "new_prompt_tokens": sources.new,
        "prompt_share": {k: by_source[k] / prompt if prompt else 0.0 for k in SHARES},
        "reuse": reuse(turns),
        "ttft_first_s": stats([t.ttft_s for t in turns if t.index == 0]),
        "ttft_later_s": stats([t.ttft_s for t in turns if t.index > 0]),
        "tpot_s": stats([s for t in turns if (s := t.tpot_s) is not None]),
        "itl_s": stats([gap for t in turns for gap in t.gaps_s]),
        "itl_token_s": stats([gap for t in turns for gap, _ in t.token_gaps()]),
        "latency_s": stats([t.latency_s for t in turns]),
        "session_s": stats(outcome.session_s),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput": {
            "turns_per_s": per_s(good_turns),
            "turns_share": good_turns / len(turns) if turns else 0.0,
            "sessions_per_s": per_s(good_sessions),
            "sessions_share": good_sessions / outcome.started if outcome.started else 0.0,
        },
        **serving_metrics(
            [_request(t) for t in turns], sum(outcome.errors.values()), seconds, report
        ),
    } | ({} if outcome.long_prompt is None else {"long_prompt": long_prompt(outcome)})


def _request(turn: TurnResult) -> Request:
    first = turn.arrived[0] if turn.arrived else turn.ttft_s
    sent = first - turn.ttft_s
    return Request(
        sent,
        turn.arrived,
        sent + turn.latency_s,
        turn.prompt_tokens,
        turn.completion_tokens,
        turn.index,
    )


def reuse(turns: list[TurnResult]) -> dict[str, Any]:
    """Of later turns: the prompt tokens the workload lets come from the cache, those that did
    by source, and the share of the allowed ones served from the GPU or CPU tier. Of first
    turns (whose shared system prompt other sessions may have left): prompt and cached tokens."""
    later = [t for t in turns if t.allowed is not None]
    first = [t for t in turns if t.allowed is None]
    allowed = sum(t.allowed or 0 for t in later)
    cached = PromptSources.total([t.sources for t in later])
    opening = PromptSources.total([t.sources for t in first])
    return {
        "turns": len(later),
        "allowed_tokens": allowed,
        "cached_tokens": cached.cached,
        "prompt_sources": msgspec.structs.asdict(cached),
        "share_of_allowed": (cached.gpu + cached.cpu) / allowed if allowed else None,
        "first_turns": {
            "turns": len(first),
            "prompt_tokens": sum(t.prompt_tokens for t in first),
            "cached_tokens": opening.cached,
            "prompt_sources": msgspec.structs.asdict(opening),
        },
    }


LONGEST_GAPS = 24


def long_prompt(outcome: Outcome) -> dict[str, Any]:
    """The long prompt's figures, and the sessions' inter-token gaps that ended while it
    waited for its first token (`itl_during_s`) against the others (`itl_rest_s`)."""
    found = outcome.long_prompt
    assert found is not None
    until = found.done if found.first is None else found.first
    begin = found.sent - found.at_s
    during: list[float] = []
    rest: list[float] = []
    longest: list[tuple[float, float, str]] = []  # gap, its end from the run's start, session
    for turn in outcome.turns:
        for a, b in pairwise(turn.arrived):
            if found.sent <= b <= until:
                during.append(b - a)
                longest.append((b - a, b - begin, turn.session))
            else:
                rest.append(b - a)
    longest.sort(reverse=True)
    token_during: list[float] = []
    token_rest: list[float] = []
    for turn in outcome.turns:
        for gap, b in turn.token_gaps():
            (token_during if found.sent <= b <= until else token_rest).append(gap)
    return {
        "at_s": found.at_s,
        "prompt_tokens": found.prompt_tokens,
        "error": found.error,
        "ttft_s": None if found.first is None else found.first - found.sent,
        "latency_s": found.done - found.sent,
        "itl_during_s": stats(during),
        "itl_rest_s": stats(rest),
        "gaps": {"during": len(during), "rest": len(rest)},
        # the same, between tokens (see `TurnResult.token_gaps`; None where not counted)
        "itl_token_during_s": stats(token_during),
        "itl_token_rest_s": stats(token_rest),
        # the longest gaps while it waited, to set beside the engine's slowest steps: many
        # sessions' gaps ending together are a stall of everything, not of one turn
        "longest_during": [
            {"gap_s": gap, "end_s": end, "session": session}
            for gap, end, session in longest[:LONGEST_GAPS]
        ],
    }
