"""Presence and frequency penalties and logit bias on the engine, with the real SmolLM2 on the
CPU (fp32) and tiers too small for the batch: requests of different penalties sampled together,
one of them suspended mid-reply (the executor forgets its counts and rebuilds them from its
output), each give the greedy tokens of a Hugging Face transformers loop that applies OpenAI's
penalties to its own logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pensieve.actors.scheduler.request import Request
from pensieve.actors.wire.step import SamplingParams
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble

pytestmark = pytest.mark.slow

BLOCK = 32
# 8 GPU blocks for four replies growing together: the last two are suspended late in their
# replies, and come back
TIERS = dict(gpu_cache_tokens=8 * BLOCK, cpu_cache_tokens=8 * BLOCK, admission_reserve=0.0)
MAX_TOKENS = 64
PROMPTS = [
    "List the colours of the rainbow.",
    "Write a line about the sea, the sea, the sea.",
    "Count from one to ten.",
    "Say hello three times.",
]


@pytest.fixture(scope="module")
def hf() -> Any:
    from transformers import AutoModelForCausalLM

    from pensieve.models.assets import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )


def reference(model: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens of transformers on the same weights (the end-of-sequence token taken as
    any other, as `ignore_eos` does), OpenAI's penalties and logit bias applied to each step's
    logits: logit - presence * (count > 0) - frequency * count + bias."""
    ids, fed, past = list(prompt), list(prompt), None
    with torch.no_grad():
        for _ in range(params.max_tokens):  # with transformers' own KV cache
            out = model(torch.tensor([fed]), past_key_values=past, use_cache=True)
            logits, past = out.logits[0, -1].float(), out.past_key_values
            counts = torch.bincount(
                torch.tensor(ids[len(prompt) :], dtype=torch.long), minlength=logits.shape[0]
            )[: logits.shape[0]].float()
            logits = logits - (
                params.presence_penalty * (counts > 0) + params.frequency_penalty * counts
            )
            for token, bias in params.logit_bias:
                logits[token] += bias
            ids.append(int(torch.argmax(logits)))
            fed = ids[-1:]
    return ids[len(prompt) :]


def test_penalized_requests_sampled_together_and_suspended_match_transformers(
    smollm2, chat, hf
) -> None:
    options = EngineOptions(model="smollm2", max_batch_tokens=512, **TIERS)
    engine = assemble(options, smollm2, chat).engine
    likeliest = smollm2.tokenizer.encode(" the", add_special_tokens=False)[0]
    settings = [  # the latest arrivals give way when the GPU tier is full: penalized ones
        SamplingParams(MAX_TOKENS, ignore_eos=True),  # none: beside the others, unchanged
        SamplingParams(MAX_TOKENS, ignore_eos=True, logit_bias=((likeliest, 8.0),)),
        SamplingParams(MAX_TOKENS, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(MAX_TOKENS, ignore_eos=True, presence_penalty=2.0, frequency_penalty=0.5),
    ]
    prompts = [chat.encode(text) for text in PROMPTS]
    started: list[Request] = [
        engine.add_request(f"c{i}", prompt, params)
        for i, (prompt, params) in enumerate(zip(prompts, settings, strict=True))
    ]
    while engine.has_work():
        engine.step()
    assert all(r.num_suspensions for r in started[2:]), "the penalized replies were not suspended"
    for request, prompt, params in zip(started, prompts, settings, strict=True):
        assert request.error is None
        assert request.output_ids == reference(hf, prompt, params), request.conv_id
    # the penalties change the replies: the same prompts without them give other tokens
    plain = SamplingParams(MAX_TOKENS, ignore_eos=True)
    assert started[2].output_ids != reference(hf, prompts[2], plain)
    assert started[1].output_ids.count(likeliest) > reference(hf, prompts[1], plain).count(
        likeliest
    )


def test_min_tokens_holds_back_the_end_of_a_reply_until_reached(smollm2, chat, hf) -> None:
    engine = assemble(EngineOptions(model="smollm2", max_batch_tokens=512), smollm2, chat).engine
    prompt = chat.encode("Reply with one word: yes or no?")
    ends = engine.eos_token_ids
    free = engine.add_request("free", prompt, SamplingParams(48))
    held = engine.add_request("held", prompt, SamplingParams(48, min_tokens=20))
    while engine.has_work():
        engine.step()
    assert len(free.output_ids) < 20 and free.output_ids[-1] in ends  # ends early by itself
    assert len(held.output_ids) >= 20 and not ends & set(held.output_ids[:20])
    # transformers, its end tokens masked for the first 20 tokens, then greedy to an end token
    want: list[int] = []
    with torch.no_grad():
        while len(want) < 48:
            logits = hf(torch.tensor([prompt + want])).logits[0, -1].float()
            if len(want) < 20:
                logits[sorted(ends)] = float("-inf")
            want.append(int(torch.argmax(logits)))
            if want[-1] in ends:
                break
    assert held.output_ids == want
