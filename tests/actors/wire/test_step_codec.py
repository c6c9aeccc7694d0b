"""The per-step channel's codec: plans survive the trip as diffs and come back whole in all the
executor reads, results round-trip, and a message of another version or a malformed one is
refused with MessageError."""

from __future__ import annotations

import base64

import msgspec
import orjson
import pytest

from pensieve.actors.wire.disk_messages import DiskInfo
from pensieve.actors.wire.messages import MessageError
from pensieve.actors.wire.step import (
    PLACEHOLDER,
    CopyOp,
    DiskLoad,
    DiskSave,
    SamplingParams,
    SeqPiece,
    StepPlan,
    SwapOrders,
)
from pensieve.actors.wire.step_codec import (
    STEP_VERSION,
    DiskRelease,
    ExecutorInfo,
    PlanDecoder,
    PlanEncoder,
    StepMessage,
    StepResult,
    release_message,
    reset_message,
)
from pensieve.actors.wire.structured import Grammar

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
HOT = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop_token_ids=(2,))
WARM = SamplingParams(
    max_tokens=8,
    temperature=0.9,
    top_k=40,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    logit_bias=((7, -100.0), (42, 3.5)),
    min_tokens=3,
    eos_ids=(2,),
    seed=4,
)


def plans() -> list[StepPlan]:
    orders = SwapOrders([CopyOp(1, 2)], [CopyOp(3, 4), CopyOp(5, 6)], [CopyOp(7, 8)], fence=True)
    return [
        StepPlan(
            (
                SeqPiece("a", (1, 2, 3), 0, 3, (10,), GREEDY),
                SeqPiece("b", (4, 5), 30, 32, (11,), None),
            )
        ),
        # a grows by a block; b's recomputed prefix and new prompt share one table
        StepPlan(
            (
                SeqPiece("a", (PLACEHOLDER,), 3, 4, (10, 12), GREEDY, 1),
                SeqPiece("b", (6,) * 4, 0, 4, (11, 13), None),
                SeqPiece("b", (7,), 32, 33, (11, 13), HOT),
            ),
            orders,
        ),
        # a's table changes in the middle (a swap-in put a chunk elsewhere); b sits out
        StepPlan((SeqPiece("a", (PLACEHOLDER,), 4, 5, (14, 12, 15), GREEDY, 2),)),
        # b comes back: sent in full again
        StepPlan((SeqPiece("b", (9,), 33, 34, (11, 13), HOT, 1),)),
        StepPlan((SeqPiece("c", (5, 6), 0, 2, (17,), WARM, 0),)),
        StepPlan(()),
    ]


def sampled(params: SamplingParams | None) -> SamplingParams | None:
    """What the executor holds of sampling parameters: the fields its sampler reads."""
    if params is None:
        return None
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
        min_tokens=params.min_tokens,
        eos_ids=params.eos_ids,
        seed=params.seed,
    )


def as_executor_sees(plan: StepPlan) -> StepPlan:
    pieces = tuple(
        SeqPiece(p.request_id, p.token_ids, p.start, p.end, p.block_table, sampled(p.sampling), i)
        for p, i in ((p, p.sample_index) for p in plan.pieces)
    )
    return StepPlan(pieces, plan.orders)


def test_plans_cross_as_diffs_and_come_back_whole() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    for step, plan in enumerate(plans(), start=1):
        data = encoder.encode(step, plan, step - 1 or None)
        got = decoder.decode(data)
        assert got is not None and got.plan == as_executor_sees(plan) and got.step == step
        assert got.feed == (step - 1 or None)
    # after a step without it, a request goes in full; then its unchanged table is not sent
    running = StepPlan((SeqPiece("a", (PLACEHOLDER,), 5, 6, (14, 12, 15), HOT, 3),))
    first = encoder.encode(9, running, None)
    assert b"[14,12,15]" in first and b"[0.7,0.9,null,3,null,0.0,0.0,0.0,[],0,[]]" in first
    assert decoder.decode(first).plan == as_executor_sees(running)  # type: ignore[union-attr]
    again = encoder.encode(10, running, 9)
    assert b"[14,12,15]" not in again and b"0.7" not in again
    assert decoder.decode(again).plan == as_executor_sees(running)  # type: ignore[union-attr]


KEYS = [bytes([i]) * 16 for i in range(4)]


def test_a_disk_tier_s_orders_cross_exactly() -> None:
    """Removals, saves from a CPU slot and from a GPU block, and loads, in their order, with
    every other order beside them."""
    orders = SwapOrders(
        [CopyOp(1, 2)],
        [CopyOp(3, 4)],
        [CopyOp(5, 6)],
        fence=True,
        disk_drop=[KEYS[3], KEYS[0]],
        disk_save=[
            DiskSave(7, KEYS[1]),
            DiskSave(None, KEYS[2], gpu_block=9),
            DiskSave(0, KEYS[0]),
        ],
        disk_load=[DiskLoad(KEYS[3], 11), DiskLoad(KEYS[1], 0)],
    )
    plan = StepPlan((SeqPiece("a", (1, 2), 0, 2, (10,), GREEDY),), orders)
    got = PlanDecoder().decode(PlanEncoder().encode(1, plan, None))
    assert isinstance(got, StepMessage) and got.plan.orders == orders
    empty = StepPlan((SeqPiece("a", (1, 2), 0, 2, (10,), GREEDY),))
    got = PlanDecoder().decode(PlanEncoder().encode(1, empty, None))
    assert isinstance(got, StepMessage) and got.plan.orders == SwapOrders()


def test_a_save_that_names_no_place_is_refused() -> None:
    key = base64.b64encode(KEYS[0]).decode()
    data = orjson.dumps(
        ["step", STEP_VERSION, "", 1, None, [], [[], [], [], False, [], [[key, None, None]], []]]
    )
    with pytest.raises(MessageError, match="StepPlan: a DiskSave names"):
        PlanDecoder().decode(data)


def test_a_disk_read_s_release_crosses_between_the_steps() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    decoder.decode(encoder.encode(1, plans()[0], None))
    assert decoder.decode(release_message(["r-1", "r-2"])) == DiskRelease(["r-1", "r-2"])
    # the requests the executor holds are kept: the next step is still a diff
    got = decoder.decode(encoder.encode(2, plans()[1], 1))
    assert isinstance(got, StepMessage) and got.plan == as_executor_sees(plans()[1])


def test_only_what_the_sampler_reads_reaches_the_executor() -> None:
    """Lengths, stop tokens and ignore_eos are the scheduler's: they never cross."""
    wide = SamplingParams(
        max_tokens=77, temperature=0.5, top_k=5, min_p=0.1, seed=9, stop_token_ids=(123,)
    )
    plan = StepPlan((SeqPiece("a", (1,), 0, 1, (4,), wide),))
    data = PlanEncoder().encode(1, plan, None)
    assert b"77" not in data and b"123" not in data
    got = PlanDecoder().decode(data)
    assert got is not None
    (params,) = [p.sampling for p in got.plan.pieces]
    assert params == SamplingParams(temperature=0.5, top_k=5, min_p=0.1, seed=9)


def test_a_running_decode_of_a_long_context_sends_only_its_new_block() -> None:
    table = tuple(range(1000, 1064))
    encoder, decoder = PlanEncoder(), PlanDecoder()
    first = StepPlan((SeqPiece("r", (PLACEHOLDER,), 2040, 2041, table, GREEDY, 1),))
    grown = StepPlan((SeqPiece("r", (PLACEHOLDER,), 2048, 2049, (*table, 7), GREEDY, 9),))
    decoder.decode(encoder.encode(1, first, None))
    data = encoder.encode(2, grown, 1)
    assert orjson.loads(data)[5] == [["r", 2048, 2049, [PLACEHOLDER], 64, [7], True, None, 9, None]]
    got = decoder.decode(data)
    assert got is not None and got.plan.pieces[0].block_table == (*table, 7)


def test_a_reset_forgets_on_both_sides() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    plan = plans()[0]
    decoder.decode(encoder.encode(1, plan, None))
    encoder.reset()
    assert decoder.decode(reset_message()) is None
    got = decoder.decode(encoder.encode(2, plan, None))
    assert got is not None and got.plan == as_executor_sees(plan)


def test_a_diff_against_a_table_the_executor_lacks_is_refused() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    encoder.encode(1, plans()[0], None)  # never delivered
    with pytest.raises(MessageError, match="keeps"):
        decoder.decode(encoder.encode(2, plans()[1], 1))


@pytest.mark.parametrize(
    "data",
    [
        b'["step", 99, "", 1, null, [], [[], [], [], false]]',
        b'["reset", 1]',
        b'{"v": 1, "kind": "step"}',  # an object: the plan of a build that sent them so
    ],
)
def test_a_plan_of_another_schema_version_is_refused(data: bytes) -> None:
    with pytest.raises(MessageError, match=f"schema version .*reads {STEP_VERSION}"):
        PlanDecoder().decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"[not json",
        b'["step", 2, "", 1]',  # fields missing
        b'["step", 2, "", 1, null, [["z", 0, 1, [1], 0, [], true, null, 0]],'
        b" [[], [], [], false]]",  # sampling never sent
        b'["step", 2, "", 1, null, [["a", 0, 1, [1], 0, [], true, [-1.0, 1.0, null, null], 0]],'
        b" [[], [], [], false]]",  # a negative temperature
        b'["step", 2, "", "one", null, [], [[], [], [], false]]',
        b'["jump", 2]',
    ],
)
def test_a_malformed_plan_is_refused_and_forgets_what_was_held(data: bytes) -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    decoder.decode(encoder.encode(1, plans()[0], None))
    with pytest.raises(MessageError, match="StepPlan"):
        decoder.decode(data)
    # the scheduler resets after the failure: a diff against the old tables is refused
    with pytest.raises(MessageError, match="keeps"):
        decoder.decode(encoder.encode(2, plans()[1], 1))


def test_a_step_result_round_trips_and_another_version_is_refused() -> None:
    swaps = [1, 2, 3, 4, 0.5, 0.25]
    result = StepResult(4, [1, 2], None, swaps, device=[1.5, 0.5], disk=[0.002, 1.0])
    data = result.encode()
    assert orjson.loads(data) == [STEP_VERSION, 4, [1, 2], None, swaps, False, [1.5, 0.5]] + [
        [0.002, 1.0]
    ]
    assert StepResult.decode(data) == result
    assert result.swap_stats().seconds_out == 0.25
    failed = StepResult(0, [], "unreadable", stale=True)
    assert StepResult.decode(failed.encode()) == failed
    with pytest.raises(MessageError, match="schema version 1"):
        StepResult.decode(b"[1, 4, [1, 2]]")
    with pytest.raises(MessageError, match="StepResult"):
        StepResult.decode(msgspec.json.encode([STEP_VERSION, 4, ["x"]]))


def test_executor_info_round_trips_and_is_versioned() -> None:
    info = ExecutorInfo("i-1", 4096, 32, 100, 200, last_step=7, last_answered=6)
    assert ExecutorInfo.decode(info.encode()) == info
    with_disk = ExecutorInfo("i-1", 4096, 32, 100, 200, disk=DiskInfo(512, 0.0005, False))
    assert ExecutorInfo.decode(with_disk.encode()) == with_disk
    assert orjson.loads(info.encode())["v"] == 1
    body = orjson.loads(info.encode())
    for bad in ({"v": 2}, {"block_size": "32"}, {"extra": 1}):
        with pytest.raises(MessageError, match="ExecutorInfo"):
            ExecutorInfo.decode(orjson.dumps({**body, **bad}))


def test_a_constrained_request_sends_its_grammar_once_and_its_output_when_given() -> None:
    constrained = SamplingParams(max_tokens=8, grammar=Grammar.json_schema({"type": "object"}))
    encoder, decoder = PlanEncoder(), PlanDecoder()
    first = StepPlan((SeqPiece("c", (1, 2), 0, 2, (10,), constrained, 3, (5, 6, 7)),))
    second = StepPlan((SeqPiece("c", (PLACEHOLDER,), 2, 3, (10,), constrained, 4),))
    got = decoder.decode(encoder.encode(1, first, None))
    assert got is not None
    (piece,) = got.plan.pieces
    assert piece.sampling is not None and piece.sampling.grammar == constrained.grammar
    assert piece.output_ids == (5, 6, 7)
    data = encoder.encode(2, second, 1)
    assert b"object" not in data  # the executor holds the grammar already
    got = decoder.decode(data)
    assert got is not None
    (piece,) = got.plan.pieces
    assert piece.sampling is not None and piece.sampling.grammar == constrained.grammar
    assert piece.output_ids is None
