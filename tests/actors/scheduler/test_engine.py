"""The engine on its own: a prompt longer than one step's token budget runs in chunks on an
idle engine and gives the tokens of an unchunked run; beside running decodes, its prefill capped
by the step budget gives every turn the tokens of an uncapped run."""

from __future__ import annotations

import itertools

from pensieve.actors.scheduler.step_timing import StepTiming
from pensieve.actors.wire.step import SamplingParams
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import build

PROMPT = [(7 * i) % 500 + 3 for i in range(300)]


def _generate(max_batch_tokens: int) -> list[int]:
    engine = build(
        EngineOptions(
            model="preset:tiny-llama",
            max_batch_tokens=max_batch_tokens,
            gpu_cache_tokens=2048,
            cpu_cache_tokens=0,
        )
    ).engine
    engine.add_request("c", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_work():
        for request in engine.step().finished:
            return request.output_ids
    raise AssertionError("the request never finished")


def test_a_prompt_over_the_step_budget_runs_in_chunks_on_an_idle_engine() -> None:
    # 300 tokens in steps of 64: the first four steps are prefill chunks that sample nothing
    assert _generate(64) == _generate(4096)


# ---- a long prompt beside running decodes, its prefill capped or not ------------------------


def _beside_decodes(slowdown: float) -> tuple[dict[str, list[int]], list[StepTiming]]:
    """Three sessions decode; a 300-token prompt arrives; every turn's tokens, by
    conversation, and the timings of the steps that decoded beside the prompt's prefill."""
    options = EngineOptions(
        model="preset:tiny-llama",
        max_batch_tokens=512,
        gpu_cache_tokens=2048,
        cpu_cache_tokens=0,
        max_step_slowdown=slowdown,
        min_prefill_tokens=32,
    )
    engine = build(options).engine
    for i in range(3):
        engine.add_request(f"s{i}", PROMPT[i * 7 : i * 7 + 20], SamplingParams(16, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    mixed: list[StepTiming] = []
    for step in itertools.count():
        if step == 2:
            engine.add_request("long", PROMPT[::-1], SamplingParams(4, ignore_eos=True))
        for request in engine.step().finished:
            outputs[request.conv_id] = request.output_ids
        timing = engine.last_timing
        if timing is not None and timing.decodes and timing.prefill_tokens:
            mixed.append(timing)
        if not engine.has_work():
            return outputs, mixed
    raise AssertionError("unreachable")


def test_a_capped_prefill_beside_decodes_gives_the_same_tokens() -> None:
    capped, capped_steps = _beside_decodes(slowdown=1.0)  # the floor: 32 tokens a step
    uncapped, uncapped_steps = _beside_decodes(slowdown=0.0)
    assert capped == uncapped and set(capped) == {"s0", "s1", "s2", "long"}
    assert all(t.prefill_tokens <= 32 and t.prefill_cap == 32 for t in capped_steps)
    assert len(capped_steps) >= 300 // 32
    assert max(t.prefill_tokens for t in uncapped_steps) == 300
    assert all(t.prefill_cap is None for t in uncapped_steps)


def test_the_stats_show_the_prefill_budget_and_its_measured_ratios() -> None:
    def stats(slowdown: float) -> object:
        options = EngineOptions(model="preset:tiny-llama", max_step_slowdown=slowdown)
        return build(options).engine.stats()["prefill_budget"]

    # on a CPU nothing times the steps: the estimate stands as it is
    assert stats(2.0) == {"max_slowdown": 2.0, "decode_ratio": 1.0, "prefill_ratio": 1.0}
    assert stats(0.0) is None
