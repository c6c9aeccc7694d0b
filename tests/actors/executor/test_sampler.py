"""Sampling is computed for every value the API accepts: no temperature or top_p raises, and the
limits behave as the distribution they tend to."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.actors.executor.sampler import sample_async
from pensieve.actors.wire.step import SamplingParams

VOCAB = 512


def _logits(seed: int) -> torch.Tensor:  # [2, VOCAB]
    return torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 8


def _sample(logits: torch.Tensor, temperature: float, top_p: float, seed: int = 1) -> list[int]:
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p, seed=seed)] * 2
    return sample_async(logits, params, [0, 1]).tolist()


def test_a_vanishing_temperature_or_top_p_samples_the_likeliest_token() -> None:
    logits = _logits(0)
    greedy = logits.argmax(dim=-1).tolist()
    for temperature, top_p in [
        (1e-40, 1.0),
        (1e-300, 1.0),
        (5e-324, 1.0),
        (0.5, 1e-300),
        (2.0, 1e-45),
        (1e-40, 1e-300),
    ]:
        assert _sample(logits, temperature, top_p) == greedy, (temperature, top_p)


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.floats(min_value=0.0, exclude_min=True, allow_infinity=False),
    top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
    seed=st.integers(0, 1000),
)
def test_every_accepted_value_samples_a_token_of_the_top_p_set(
    temperature: float, top_p: float, seed: int
) -> None:
    logits = _logits(seed)
    tokens = _sample(logits, temperature, top_p, seed)
    for row, token in enumerate(tokens):
        assert 0 <= token < VOCAB
        # inside the nucleus: the mass of the tokens likelier than it (in the sampler's float32
        # arithmetic) is below top_p
        scaled = (logits[row] - logits[row].max()) / max(temperature, torch.finfo().tiny)
        probs = torch.softmax(scaled, dim=-1)
        above = probs[probs > probs[token]].sum().item()
        assert above < top_p + 1e-5 or token == int(logits[row].argmax())


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch() -> None:
    logits = _logits(7)
    alone = _sample(logits, 0.9, 0.95, seed=11)
    sampled = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=11)
    beside_greedy = sample_async(
        torch.cat([logits[:1], logits]), [SamplingParams(max_tokens=4), sampled, sampled], [0, 0, 1]
    ).tolist()
    assert beside_greedy[1:] == alone
