"""Chunk keys name a whole prefix, within one namespace."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pensieve.actors.scheduler.kv.chunk_keys import chunk_key, extend_keys, keys_of, namespace

SEED = namespace("smollm2-135m", "acme")
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@given(a=tokens, b=tokens)
def test_two_sequences_share_the_keys_of_exactly_their_common_full_chunks(a, b):
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    keys_a, keys_b = keys_of(SEED, a, 4), keys_of(SEED, b, 4)
    assert len(keys_a) == len(a) // 4
    shared = sum(1 for x, y in zip(keys_a, keys_b, strict=False) if x == y)
    assert shared == min(common // 4, len(keys_a), len(keys_b))


@given(head=tokens, tail=tokens)
def test_keys_extend_incrementally(head, tail):
    keys = keys_of(SEED, head, 4)
    extend_keys(keys, SEED, head + tail, 4)
    assert keys == keys_of(SEED, head + tail, 4)


def test_a_key_is_chained_to_its_parent_and_seeded_by_its_namespace():
    chunk = [1, 2, 3, 4]
    assert keys_of(SEED, chunk * 2, 4) == [
        chunk_key(SEED, chunk),
        chunk_key(chunk_key(SEED, chunk), chunk),
    ]
    seeds = {
        namespace("smollm2-135m", "acme"),
        namespace("smollm2-135m", "other"),
        namespace("llama3.1-8b", "acme"),
        namespace("smollm2-135m", "acme", cache_salt="s"),
        namespace("smollm2-135m", "acme", cache_salt=""),  # the same as no salt
        namespace("smollm2-135m", "acmes"),
        namespace("smollm2-135m", None, "acme"),  # the parts cannot run into each other
    }
    assert len(seeds) == 6
    assert len({chunk_key(seed, chunk) for seed in seeds}) == 6
