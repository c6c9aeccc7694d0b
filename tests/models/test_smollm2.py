"""The real model: SmolLM2-135M-Instruct (GGUF, Q4_1) against transformers' own GGUF loading.

transformers' side parses the file several times and takes tens of seconds, so each side loads
once per module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from paged_generate import greedy_generate, prompt_logits
from transformers import AutoModelForCausalLM

from pensieve.models import Arch, LoadedModel, load_model
from pensieve.models.assets import smollm2_gguf_path

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model("smollm2", "cpu", torch.float32)


@pytest.fixture(scope="module")
def reference() -> Any:
    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        attn_implementation="eager",
        local_files_only=True,
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompt(ours: LoadedModel) -> list[int]:
    tokenizer = ours.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def test_config_and_tokenizer(ours: LoadedModel, prompt: list[int]) -> None:
    config = ours.config
    assert config.arch is Arch.LLAMA
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads)
    assert shape == (30, 576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert ours.tokenizer.eos_token_id in config.eos_token_ids
    assert ours.tokenizer.decode(prompt).startswith("<|im_start|>system")


def test_logits_match(ours: LoadedModel, reference: Any, prompt: list[int]) -> None:
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    got = prompt_logits(ours.model, prompt)
    rel = float((got - expected).norm() / expected.norm())
    assert rel < 1e-4, f"relative logit error {rel:.2e}"


def test_greedy_tokens_match(ours: LoadedModel, reference: Any, prompt: list[int]) -> None:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False
        )
    expected = out[0, len(prompt) :].tolist()
    (got,) = greedy_generate(
        ours.model, [prompt], NUM_NEW_TOKENS, block_size=8, eos_token_ids=ours.config.eos_token_ids
    )
    assert got == expected, ours.tokenizer.decode(got)
    assert len(got) == NUM_NEW_TOKENS  # the prompt asks for a story: no early EOS
