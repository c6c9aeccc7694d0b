"""Sampling is computed for every value the API accepts: no temperature or top_p raises, and the
limits behave as the distribution they tend to; rows of different settings (temperature, top-k,
top-p, min-p) sampled in one batch each follow their own truncated distribution, and top-k
keeps the k likeliest tokens."""

from __future__ import annotations

import pytest
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


def _truncated(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, min_p: float
):
    """The distribution a row samples from, by the definitions: the tokens at least min_p times
    as likely as the likeliest, of them the top_k likeliest, then those of them whose likelier
    tokens hold less than top_p of the mass, renormalized."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    order = [t for t in order if probs[t] >= min_p * probs.max()]
    kept = order[: top_k or len(order)]
    mass = probs[kept] / probs[kept].sum()
    before = torch.cumsum(mass, dim=0) - mass
    nucleus = [t for t, b in zip(kept, before.tolist(), strict=True) if b < top_p or t == kept[0]]
    want = torch.zeros_like(probs)
    want[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return want


SETTINGS = [  # temperature, top_k, top_p, min_p
    (1.0, None, 1.0, 0.0),
    (0.5, 3, 1.0, 0.0),
    (1.3, None, 0.7, 0.0),
    (0.8, 4, 0.9, 0.0),
    (1.5, None, 1.0, 0.2),
    (1.0, 5, 0.95, 0.1),
]


def test_rows_of_different_settings_in_one_batch_each_follow_their_own_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    draws = 8000  # per setting: seeded, so the counts are the same on every run
    params, indices = [], []
    for seed in range(draws):
        for temperature, top_k, top_p, min_p in SETTINGS:
            params.append(SamplingParams(4, temperature, top_p, top_k, min_p, seed=seed))
            indices.append(seed % 5)
    tokens = sample_async(logits.repeat(len(params), 1), params, indices).tolist()
    for i, setting in enumerate(SETTINGS):
        counts = torch.bincount(torch.tensor(tokens[i :: len(SETTINGS)]), minlength=len(logits))
        want = _truncated(logits, *setting)
        assert counts[want == 0].sum() == 0, (SETTINGS[i], counts)  # never outside the set
        share = counts.double() / draws
        spread = 4 * torch.sqrt(want * (1 - want) / draws) + 1e-3
        assert bool(((share - want).abs() <= spread).all()), (SETTINGS[i], share, want)


@settings(max_examples=100, deadline=None)
@given(
    temperature=st.floats(min_value=1e-3, max_value=100.0),
    top_k=st.integers(1, VOCAB + 5),
    seed=st.integers(0, 1000),
)
def test_top_k_samples_one_of_the_k_likeliest_tokens(
    temperature: float, top_k: int, seed: int
) -> None:
    logits = _logits(seed)
    params = [SamplingParams(4, temperature, 1.0, top_k, seed=seed)] * 2
    tokens = sample_async(logits, params, [0, 1]).tolist()
    for row, token in enumerate(tokens):
        likelier = int((logits[row] > logits[row, token]).sum())
        assert likelier < top_k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_on_the_gpu_leaves_the_step_running_and_draws_the_hosts_tokens() -> None:
    logits = _logits(3)
    params = [SamplingParams(4, 0.9, 0.95, 20, seed=5), SamplingParams(4, 1.2, seed=6)]
    want = sample_async(logits, params, [0, 1]).tolist()
    on_gpu = logits.cuda()
    sample_async(on_gpu, params, [0, 1]).tolist()  # kernels loaded and pinned memory cached,
    # as in any step after the first: both wait for the device once
    torch.cuda._sleep(400_000_000)  # the step that made the logits, still running
    tokens = sample_async(on_gpu, params, [0, 1])
    assert not torch.cuda.current_stream().query()  # the host did not wait for it
    assert tokens.tolist() == want
