"""Placement in the ingress, fed load reports and KV event batches of three engines as they
would send them: a new conversation goes to the least loaded live engine, a burst between two
reports is spread, a resent history goes where its prefix is cached unless that engine is
loaded more than the prefix is worth, another tenant's prompt never matches, and an engine
that stops reporting is not placed on."""

from __future__ import annotations

import random

from pensieve.actors.ingress.placement import (
    Choice,
    Placement,
    PlacementConfig,
    Policy,
    PromptKeys,
    Reason,
)
from pensieve.actors.wire.chunk_keys import namespace
from pensieve.actors.wire.messages import KvEvent, KvEventBatch, KvEventKind, LoadReport

BLOCK = 32
KEYS = PromptKeys("smollm2", BLOCK)
PROMPT = list(range(100, 100 + 10 * BLOCK + 5))  # ten full chunks and a partial one


def report(engine: str, active_tokens: int = 0, time: float = 1.0, free: int = 100) -> LoadReport:
    return LoadReport(engine, time, BLOCK, 1 if active_tokens else 0, 0, active_tokens, free, 100)


def holding(engine: str, keys: list[bytes], num_chunks: int, tenant: str | None) -> KvEventBatch:
    """Batch 1 of `engine`: one conversation's first `num_chunks` chunks sealed on the GPU."""
    seed = namespace("smollm2", tenant)
    events = tuple(
        KvEvent(KvEventKind.SEALED, "c-1", i, i, None, keys[i], keys[i - 1] if i else seed)
        for i in range(num_chunks)
    )
    return KvEventBatch(engine, 1, 1.0, events)


def placement(*reports: LoadReport, policy: Policy = Policy.PREFIX) -> Placement:
    placed = Placement("a", PlacementConfig(policy), random.Random(0))
    for one in reports:
        placed.report(one, now=0.0)
    return placed


def test_a_new_conversation_goes_to_the_least_loaded_engine() -> None:
    placed = placement(report("a", 40 * BLOCK), report("b", 3 * BLOCK), report("c", 9 * BLOCK))
    choice = placed.place(now=0.1)
    assert (choice.engine_id, choice.reason) == ("b", Reason.LOAD)


def test_turns_placed_between_two_reports_count_as_load() -> None:
    placed = placement(report("a"), report("b"), report("c"))
    burst = [placed.place(now=0.1, num_prompt_tokens=4 * BLOCK).engine_id for _ in range(6)]
    assert sorted(burst) == ["a", "a", "b", "b", "c", "c"]
    placed.report(report("a", time=2.0), now=0.2)  # a's new report: what it has in hand now
    assert placed.place(now=0.3).engine_id == "a"


def test_an_engine_that_stopped_reporting_is_not_placed_on() -> None:
    placed = placement(report("a", 40 * BLOCK), report("b"))
    ttl = placed.config.report_ttl_s
    placed.report(report("a", 40 * BLOCK, time=2.0), now=ttl)  # b has said nothing since
    assert placed.live(now=ttl + 0.1) == ["a"]
    assert placed.place(now=ttl + 0.1) == placed.place(now=ttl + 0.2)
    assert placed.place(now=ttl + 0.1).reason is Reason.ONLY


def test_a_report_older_than_the_one_in_hand_only_says_the_engine_lives() -> None:
    # the report `a` sent as its turn ended (nothing in hand), then its periodic report of a
    # snapshot taken before that, while the turn still ran
    placed = placement(report("a", time=2.0), report("b", 4 * BLOCK, time=2.0))
    ttl = placed.config.report_ttl_s
    placed.report(report("a", 40 * BLOCK, time=1.9), now=ttl)
    placed.report(report("b", 4 * BLOCK, time=2.0 + ttl), now=ttl)
    assert placed.live(now=ttl + 0.1) == ["a", "b"]  # heard from within the TTL
    assert placed.place(now=ttl + 0.1).engine_id == "a"  # by its newer report: idle


def test_a_resent_history_goes_where_its_prefix_is_cached() -> None:
    keys = KEYS.of(PROMPT, "acme", None)
    assert len(keys) == 10
    placed = placement(report("a"), report("b", 4 * BLOCK), report("c"))
    placed.kv_events(holding("b", keys, 8, "acme"))
    choice = placed.place(now=0.1, keys=keys, num_prompt_tokens=len(PROMPT))
    # b: 3 blocks to prefill (11 - 8) and 4 in hand; a and c: 11 to prefill
    assert (choice.engine_id, choice.reason) == ("b", Reason.PREFIX)
    assert (choice.num_cached_blocks, choice.cost) == (8, 7.0)


def test_a_prefix_is_not_worth_any_load() -> None:
    keys = KEYS.of(PROMPT, None, None)
    placed = placement(report("a"), report("b", 30 * BLOCK))
    placed.kv_events(holding("b", keys, 10, None))
    choice = placed.place(now=0.1, keys=keys, num_prompt_tokens=len(PROMPT))
    assert (choice.engine_id, choice.reason) == ("a", Reason.LOAD)  # 11 < 1 + 30
    heavier = Placement("a", PlacementConfig(prefix_weight=4.0))  # 44 > 4 + 30
    for one in (report("a"), report("b", 30 * BLOCK)):
        heavier.report(one, now=0.0)
    heavier.kv_events(holding("b", keys, 10, None))
    assert heavier.place(now=0.1, keys=keys, num_prompt_tokens=len(PROMPT)).engine_id == "b"


def test_another_tenants_prompt_never_matches() -> None:
    acme = KEYS.of(PROMPT, "acme", None)
    placed = placement(report("a"), report("b", 2 * BLOCK))
    placed.kv_events(holding("b", acme, 10, "acme"))
    for tenant, salt in (("other", None), (None, None), ("acme", "salted")):
        keys = KEYS.of(PROMPT, tenant, salt)
        assert not set(keys) & set(acme)
        choice = placed.place(now=0.1, keys=keys, num_prompt_tokens=len(PROMPT))
        assert choice.num_cached_blocks == 0 and choice.reason is Reason.LOAD


def test_the_load_and_random_policies_read_no_prefix() -> None:
    keys = KEYS.of(PROMPT, None, None)
    loads = placement(report("a"), report("b", BLOCK), policy=Policy.LOAD)
    loads.kv_events(holding("b", keys, 10, None))
    assert not loads.wants_prompt(now=0.1)
    assert loads.place(now=0.1) == Choice("a", Reason.LOAD, 0, 0.0)
    randoms = placement(report("a"), report("b", BLOCK), policy=Policy.RANDOM)
    assert not randoms.wants_prompt(now=0.1)
    chosen = [randoms.place(now=0.1) for _ in range(20)]
    assert {c.engine_id for c in chosen} == {"a", "b"}
    assert {c.reason for c in chosen} == {Reason.RANDOM}
    assert placement(report("a"), report("b")).wants_prompt(now=0.1)
