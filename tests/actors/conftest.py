"""The real SmolLM2 (fp32 on the CPU) and its chat tokenizer, loaded once per test module that
asks for them."""

from __future__ import annotations

import pytest
import torch

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.models.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2", "cpu", torch.float32)


@pytest.fixture(scope="module")
def chat(smollm2: LoadedModel) -> ChatTokenizer:
    return ChatTokenizer(smollm2.tokenizer, smollm2.config.vocab_size)
