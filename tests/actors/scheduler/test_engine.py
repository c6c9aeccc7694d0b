"""The engine on its own: a prompt longer than one step's token budget runs in chunks on an
idle engine and gives the tokens of an unchunked run."""

from __future__ import annotations

from pensieve.actors.wire.step import SamplingParams
from pensieve.ops.factory import EngineOptions, build

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
