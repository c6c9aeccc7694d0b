"""The executor's penalties on plain tensors: OpenAI's formula on the logits of the penalized
rows only, counts that follow the tokens sampled, a request forgotten when a step leaves it out
and rebuilt from its output, and a clear error when its output is missing."""

from __future__ import annotations

import pytest
import torch

from pensieve.actors.executor.penalties import Penalties
from pensieve.actors.wire.step import SamplingParams, SeqPiece

VOCAB = 8
PENALIZED = SamplingParams(4, presence_penalty=1.0, frequency_penalty=0.5)
BIASED = SamplingParams(4, logit_bias=((2, 3.0), (5, -1.0)))


def piece(request_id: str, params: SamplingParams, index: int, output=None) -> SeqPiece:
    return SeqPiece(request_id, (0,), 0, 1, (0,), params, index, output)


def test_penalties_follow_the_tokens_sampled_and_are_rebuilt_from_the_output() -> None:
    penalties = Penalties(torch.device("cpu"))
    step = [piece("a", PENALIZED, 3, (1, 1, 4)), piece("b", BIASED, 0, ())]
    logits = torch.zeros(2, VOCAB)
    rows = penalties.apply(logits, step)
    assert rows == [0]
    want = torch.zeros(2, VOCAB)
    want[0, 1] = -(1.0 + 2 * 0.5)
    want[0, 4] = -(1.0 + 0.5)
    want[1, 2], want[1, 5] = 3.0, -1.0
    assert torch.equal(logits, want)
    penalties.sampled(torch.tensor([4, 2]), step, rows)  # a draws 4 again
    logits = torch.zeros(1, VOCAB)
    penalties.apply(logits, [piece("a", PENALIZED, 4)])  # no output sent: the counts held
    assert logits[0, 4] == -(1.0 + 2 * 0.5) and logits[0, 1] == -(1.0 + 2 * 0.5)
    penalties.forget_absent([piece("b", BIASED, 1)])  # a left out: forgotten
    assert penalties.num_penalized == 0
    with pytest.raises(ValueError, match="without its output so far"):
        penalties.apply(torch.zeros(1, VOCAB), [piece("a", PENALIZED, 4)])
    logits = torch.zeros(1, VOCAB)
    penalties.apply(logits, [piece("a", PENALIZED, 4, (1, 1, 4, 4))])
    assert logits[0, 4] == logits[0, 1] == -(1.0 + 2 * 0.5) and logits[0, 0] == 0
