"""Chunk keys name a whole prefix, within one namespace."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pensieve.actors.wire.chunk_keys import (
    Namespace,
    PublicKeys,
    chunk_key,
    extend_keys,
    keys_of,
    namespace,
    public_seed,
)

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


# ---- public prompts: shared across tenants, their continuations not ----------------------

MODEL = "smollm2-135m"
PUBLIC_PROMPT = list(range(100, 110))  # two full chunks of 4 and a partial one
PUBLIC_PROMPTS = [PUBLIC_PROMPT, [7, 7, 7, 7, 7]]
PUBLIC = PublicKeys.of(MODEL, PUBLIC_PROMPTS, 4)
ALICE = Namespace(namespace(MODEL, "alice"), PUBLIC)
BOB = Namespace(namespace(MODEL, "bob"), PUBLIC)
# prompts made of public prompts' chunks and others, in any order, and a partial chunk
CHUNKS = [[100, 101, 102, 103], [104, 105, 106, 107], [104, 105, 0, 0], [7, 7, 7, 7], [1, 2, 3, 4]]
small = st.builds(
    lambda chunks, tail: [t for chunk in chunks for t in chunk] + tail,
    st.lists(st.sampled_from(CHUNKS), max_size=5),
    st.lists(st.sampled_from([0, 7, 104]), max_size=3),
)


def is_public(tokens: list[int]) -> bool:
    """Whether `tokens` begin some public prompt."""
    return any(p[: len(tokens)] == tokens for p in PUBLIC_PROMPTS if len(p) >= len(tokens))


def test_a_public_prefix_is_keyed_alike_for_every_tenant_and_what_follows_it_is_not():
    prompt = PUBLIC_PROMPT + [1, 2, 3, 4, 5, 6, 7, 8]  # 4 full chunks: 2 public, 2 private
    alice, bob = ALICE.keys_of(prompt, 4), BOB.keys_of(prompt, 4)
    assert alice[:2] == bob[:2] == keys_of(public_seed(MODEL), PUBLIC_PROMPT, 4)
    assert alice[2] != bob[2] and alice[3] != bob[3]
    assert not set(alice[2:]) & PUBLIC.keys
    # without public prompts a tenant keys it all alone, as every tenant does without the option
    plain = Namespace(namespace(MODEL, "alice")).keys_of(prompt, 4)
    assert plain == keys_of(namespace(MODEL, "alice"), prompt, 4)
    assert not set(plain) & set(bob)


def test_a_prompt_that_departs_from_a_public_one_mid_chunk_is_public_only_before_that_chunk():
    prompt = PUBLIC_PROMPT[:6] + [0, 0, 0]  # departs in the second chunk
    alice, bob = ALICE.keys_of(prompt, 4), BOB.keys_of(prompt, 4)
    assert alice[0] == bob[0] in PUBLIC.keys
    assert alice[1] != bob[1] and alice[1] not in PUBLIC.keys
    # the partial last chunk of a public prompt has no public key: a prompt through it is private
    through = PUBLIC_PROMPT + [0, 0]
    alice, bob = ALICE.keys_of(through, 4), BOB.keys_of(through, 4)
    assert alice[:2] == bob[:2] and set(alice[:2]) <= PUBLIC.keys
    assert alice[2] != bob[2] and alice[2] not in PUBLIC.keys


def test_a_key_after_a_public_prefix_names_that_prefix():
    tail = [1, 2, 3, 4]
    after_public = ALICE.keys_of(PUBLIC_PROMPT[:8] + tail, 4)[2]
    after_other = ALICE.keys_of([7, 7, 7, 7, 7, 7, 7, 7] + tail, 4)[2]
    after_own = ALICE.keys_of([9] * 8 + tail, 4)[2]
    assert len({after_public, after_other, after_own}) == 3


@given(a=small, b=small)
def test_two_tenants_share_exactly_the_public_chunks_of_their_common_prefix(a, b):
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    keys_a, keys_b, keys_a2 = ALICE.keys_of(a, 4), BOB.keys_of(b, 4), ALICE.keys_of(b, 4)
    for i, (x, y) in enumerate(zip(keys_a, keys_b, strict=False)):
        end = (i + 1) * 4
        assert (x == y) == (end <= common and is_public(a[:end]))
        assert (x in PUBLIC.keys) == is_public(a[:end])
    # within one tenant, public or not, equal keys are exactly the common full chunks
    same = sum(1 for x, y in zip(keys_a, keys_a2, strict=False) if x == y)
    assert same == min(common // 4, len(keys_a), len(keys_a2))


@given(head=small, tail=small)
def test_keys_with_public_prompts_extend_incrementally(head, tail):
    keys = ALICE.keys_of(head, 4)
    ALICE.extend(keys, head + tail, 4)
    assert keys == ALICE.keys_of(head + tail, 4)
