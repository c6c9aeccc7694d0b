"""The Triton paged attention and KV-write kernels against the torch reference in float64.

Inputs are drawn fresh on every run; each assertion message carries the seed that reproduces it
(set REPRO_SEED to that value). Without CUDA the kernels run in Triton's CPU interpreter
(tests/conftest.py), so the CPU sizes are small; tests marked gpu run the full sizes on CUDA.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, replace

import pytest
import torch

from pensieve.kernels import AttentionImpl, paged_attention
from pensieve.kernels.metadata import AttentionMetadata, build_metadata
from pensieve.kernels.reference import paged_attention_ref, write_kv_ref
from pensieve.kernels.triton_attention import (
    KernelConfig,
    choose_config,
    paged_attention_triton,
    write_kv_triton,
)

REPRO_SEED: int | None = None  # set to a failing run's seed to replay it
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def gpu(test):
    """Full-size test: marked gpu, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs CUDA")(test))


# fp32 dots run in IEEE fp32 (no tf32), so only accumulation-order rounding remains; bf16/fp16
# round P before the PV product and the output once: a few units of their last place.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 3e-3}


@pytest.fixture
def rng() -> random.Random:
    seed = REPRO_SEED if REPRO_SEED is not None else int.from_bytes(os.urandom(4), "little")
    return random.Random(seed)


def seed_of(rng: random.Random) -> int:
    return rng.getrandbits(31)


@dataclass(frozen=True)
class SubSeq:
    conversation: int  # sub-sequences of one conversation share its block-table row
    query_len: int
    seq_len: int


@dataclass(frozen=True)
class Case:
    query: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata
    seed: int

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[2])


def make_case(
    rng: random.Random,
    subseqs: list[SubSeq],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
) -> Case:
    """Random query and cache; each conversation's pages scattered through a shuffled pool."""
    seed = seed_of(rng)
    gen = torch.Generator(DEVICE).manual_seed(seed)
    lengths: dict[int, int] = {}
    for s in subseqs:
        lengths[s.conversation] = max(lengths.get(s.conversation, 0), s.seq_len)
    pages = {c: -(-n // block_size) + rng.randint(0, 2) for c, n in lengths.items()}
    num_blocks = sum(pages.values()) + rng.randint(1, 8)
    pool = rng.sample(range(num_blocks), num_blocks)
    tables = {}
    for c, n in pages.items():
        tables[c], pool = pool[:n], pool[n:]
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    num_tokens = sum(s.query_len for s in subseqs)
    query_shape = (num_tokens, num_kv_heads * group, head_dim)
    query = torch.randn(query_shape, generator=gen, device=DEVICE).to(dtype)
    meta = build_metadata(
        [s.query_len for s in subseqs],
        [s.seq_len for s in subseqs],
        [tables[s.conversation] for s in subseqs],
        block_size,
        device=DEVICE,
    )
    return Case(query, kv_cache, meta, seed)


def random_subseqs(rng: random.Random, num: int, max_query: int, max_context: int) -> list[SubSeq]:
    out = []
    for i in range(num):
        qlen = rng.choice([1, rng.randint(1, max_query)])
        out.append(SubSeq(i, qlen, qlen + rng.randint(0, max_context)))
    return out


def prefix_recompute(rng: random.Random, conversation: int, max_len: int) -> list[SubSeq]:
    """A: dropped prefix [0, P) recomputed; B: new prompt [C, N) over everything; one table."""
    n = rng.randint(4, max_len)
    c = rng.randint(2, n - 1)
    p = rng.randint(1, c)
    return [SubSeq(conversation, p, p), SubSeq(conversation, n - c, n)]


def check(case: Case, config: KernelConfig | None = None) -> None:
    out = torch.full_like(case.query, float("nan"))
    paged_attention_triton(case.query, case.kv_cache, case.meta, case.scale, out=out, config=config)
    where = f"seed={case.seed} config={config} q={case.meta.query_lens_host} "
    where += f"s={case.meta.seq_lens_host}"
    assert not out.isnan().any(), f"unwritten or NaN output; {where}"
    ref = paged_attention_ref(
        case.query.double(), case.kv_cache.double(), case.meta, case.scale
    )  # [T, Hq, D] float64
    tol = TOLERANCE[case.query.dtype]
    err = ((out.double() - ref).abs() / (tol * (1 + ref.abs()))).max().item()
    assert err <= 1, f"error {err:.2f}x the tolerance {tol}; {where}"


# ---------------------------------------------------------------- small sizes (CPU interpreter)


@pytest.mark.parametrize(
    ("dtype", "block_size", "group", "head_dim"),
    [
        (torch.float32, 16, 1, 64),
        (torch.bfloat16, 32, 4, 128),
        (torch.float16, 16, 8, 32),
        (torch.float32, 32, 3, 16),  # a group that does not divide the tile's rows
    ],
)
def test_mixed_batch(rng, dtype, block_size, group, head_dim):
    subseqs = random_subseqs(rng, rng.randint(1, 5), max_query=80, max_context=300)
    case = make_case(
        rng,
        subseqs,
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    check(case)


def test_prefix_recompute_shares_block_table(rng):
    subseqs = prefix_recompute(rng, 0, 150) + [SubSeq(1, 1, rng.randint(1, 90))]
    case = make_case(
        rng, subseqs, block_size=16, num_kv_heads=2, group=4, head_dim=32, dtype=torch.bfloat16
    )
    check(case)


@pytest.mark.parametrize(
    "config",
    [
        KernelConfig(16, 16, 4, 2),  # KV tile narrower than a page
        KernelConfig(32, 64, 4, 2, kv_split_len=64),  # tiles spanning pages, split KV
        KernelConfig(64, 32, 4, 2, kv_split_len=96),  # splits of several tiles
    ],
)
def test_tile_shapes_and_splits(rng, config):
    subseqs = [SubSeq(0, rng.randint(1, 12), rng.randint(150, 260)), SubSeq(1, 1, 70)]
    subseqs += prefix_recompute(rng, 2, 120)
    case = make_case(
        rng, subseqs, block_size=32, num_kv_heads=1, group=4, head_dim=32, dtype=torch.float32
    )
    check(case, config)


def test_decode_batch_takes_split_path(rng):
    subseqs = [SubSeq(i, 1, rng.randint(1, 1200)) for i in range(2)] + [SubSeq(2, 1, 1100)]
    case = make_case(
        rng, subseqs, block_size=16, num_kv_heads=1, group=8, head_dim=16, dtype=torch.bfloat16
    )
    config = choose_config(3, 3, 1, 1100, 8, 1, 16, 2, 4)
    assert config.kv_split_len is not None  # 4 SMs as the interpreter reports them
    check(case)


def test_decodes_short_of_one_wave_are_split_until_they_fill_the_gpu():
    """Decodes of 40 sequences over half of 10 KV heads (one of two tensor-parallel ranks) are
    200 programs where an H100 or H200 holds 396 decode tiles at once: split in two, not left
    to walk their KV alone on half the SMs. One decode over 10 heads at 4k takes 2-tile splits
    (32), not 8 of 512 positions. Multi-token tiles still round down: 32 sequences of 8 tokens
    over 10 heads stay whole. Each pick came within 1.03x of the fastest count on an H200
    (`bench_kernels.py --splits`)."""
    sms = 132
    assert choose_config(40, 40, 1, 1536, 4, 5, 128, 2, sms).num_splits(1536) == 2
    assert choose_config(64, 64, 1, 4096, 4, 5, 128, 2, sms).num_splits(4096) == 2
    assert choose_config(1, 1, 1, 4096, 4, 10, 128, 2, sms).num_splits(4096) == 32
    assert choose_config(8, 8, 1, 4096, 4, 5, 128, 2, sms).num_splits(4096) == 10
    # long contexts: splits of 512 positions at least, as many as fill the GPU (80 asked over
    # 5 heads, 79 once cut into whole tiles), 256 at most for one head
    assert choose_config(1, 1, 1, 131072, 4, 5, 128, 2, sms).num_splits(131072) == 79
    assert choose_config(1, 1, 1, 131072, 4, 1, 128, 2, sms).num_splits(131072) == 256
    assert choose_config(256, 32, 8, 1024, 4, 10, 128, 2, sms).num_splits(1024) == 1


@pytest.mark.parametrize("split", [None, 64])
def test_decodes_take_one_tile_per_sub_sequence(rng, split):
    """A launch whose sub-sequences each have one query token (decodes) gives tile s to
    sub-sequence s: no empty tiles, no search for the sub-sequence; unsplit and split KV."""
    from pensieve.kernels.triton_attention import AttentionPlan

    subseqs = [SubSeq(i, 1, rng.randint(1, 300)) for i in range(rng.randint(2, 7))]
    case = make_case(
        rng, subseqs, block_size=16, num_kv_heads=2, group=4, head_dim=16, dtype=torch.float32
    )
    config = KernelConfig(16, 32, 4, 2, kv_split_len=split)
    (launch,) = AttentionPlan(
        case.query, case.kv_cache, case.meta, case.scale, config=config
    ).launches
    assert launch.grid[:2] == (2, len(subseqs)) and launch.options["SINGLE"]
    assert launch.options["BLOCK_Q"] == 1
    check(case, config)
    check(case)  # the launch shape choose_config picks


def test_splits_cut_for_a_context_bucket_spread_each_sub_sequence_over_all_of_them(rng):
    """A CUDA graph launches the KV split of its context bucket, up to twice the longest context
    in the step: each sub-sequence still spreads its KV over every split (the longest leaves
    none idle, where it used to fill only the first half), and the output is exact."""
    from pensieve.kernels.triton_attention import AttentionPlan

    subseqs = [SubSeq(0, 1, 1000), SubSeq(1, 1, 600), SubSeq(2, 1, 30)]
    case = make_case(
        rng, subseqs, block_size=16, num_kv_heads=2, group=4, head_dim=16, dtype=torch.float32
    )
    bucket = Case(case.query, case.kv_cache, replace(case.meta, max_seq_len=2048), case.seed)
    config = KernelConfig(16, 16, 4, 2, kv_split_len=256)  # 8 splits of the 2,048 bucket
    plan = AttentionPlan(bucket.query, bucket.kv_cache, bucket.meta, bucket.scale, config=config)
    (launch,) = plan.launches
    assert launch.grid == (2, 3, 8)
    check(bucket, config)
    assert launch.part_lse is not None
    out = torch.empty_like(bucket.query)
    plan.run(bucket.query, bucket.kv_cache, out)
    seen = launch.part_lse.isfinite()  # [split, token, head]: a split that attended to keys
    assert seen[:, 0].all() and seen[:, 1].all(), seen[:, :2, 0]  # 1000 and 600 keys: all 8
    assert seen[:, 2, 0].sum() == 1  # 30 keys: one split of at least 4 tiles


def test_mixed_step_runs_decodes_on_their_own_tiles(rng):
    # leading decodes, then a prompt long enough for multi-token tiles and a shared-table pair
    decodes = [SubSeq(i, 1, rng.randint(1, 300)) for i in range(rng.randint(1, 4))]
    n = len(decodes)
    subseqs = [*decodes, SubSeq(n, rng.randint(20, 40), rng.randint(40, 200))]
    subseqs += prefix_recompute(rng, n + 1, 120)
    case = make_case(
        rng, subseqs, block_size=16, num_kv_heads=2, group=4, head_dim=16, dtype=torch.float32
    )
    parts = case.meta.split_singles()
    assert parts is not None and parts[0].num_seqs == len(decodes)
    assert parts[1].cu_query_lens.tolist() == [
        c - len(decodes) for c in case.meta.cu_query_lens.tolist()[len(decodes) :]
    ]
    check(case)  # the two launches together cover every row (NaN-poisoned output)


def test_dispatch_runs_triton(rng):
    case = make_case(
        rng,
        [SubSeq(0, 3, 20)],
        block_size=16,
        num_kv_heads=1,
        group=2,
        head_dim=16,
        dtype=torch.float32,
    )
    out = paged_attention(
        case.query, case.kv_cache, case.meta, case.scale, impl=AttentionImpl.TRITON
    )
    ref = paged_attention_ref(case.query, case.kv_cache, case.meta, case.scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, msg=f"seed={case.seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(rng, dtype):
    seed = seed_of(rng)
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 3, 32, 40
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    # key and value as strided views of one fused projection, as a model produces them
    qkv = torch.randn((num_tokens, 4 * num_kv_heads, head_dim), generator=gen).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 3 * num_kv_heads :]
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    expected = cache.clone()
    write_kv_ref(key, value, expected, slots)
    cache, key, value = cache.to(DEVICE), key.to(DEVICE), value.to(DEVICE)
    write_kv_triton(key, value, cache, slots.to(DEVICE))
    assert torch.equal(cache.cpu().nan_to_num(7.0), expected.nan_to_num(7.0)), f"seed={seed}"


# ----------------------------------------------------------------------- full sizes (CUDA)


@pytest.mark.parametrize(
    ("dtype", "block_size", "group", "head_dim"),
    [
        (torch.bfloat16, 16, 1, 64),
        (torch.bfloat16, 32, 4, 128),
        (torch.bfloat16, 16, 8, 128),
        (torch.bfloat16, 32, 8, 64),
        (torch.bfloat16, 32, 1, 128),
        (torch.bfloat16, 16, 4, 64),
        (torch.float32, 16, 4, 128),
        (torch.float32, 32, 1, 64),
        (torch.float32, 32, 8, 128),
        (torch.float16, 32, 4, 128),
        (torch.float16, 16, 1, 128),
        (torch.float16, 16, 8, 64),
    ],
)
@gpu
def test_gpu_mixed_batch(rng, dtype, block_size, group, head_dim):
    subseqs = random_subseqs(rng, rng.randint(1, 12), max_query=300, max_context=2000)
    subseqs += prefix_recompute(rng, 100, 2300)
    rng.shuffle(subseqs)
    case = make_case(
        rng,
        subseqs,
        block_size=block_size,
        num_kv_heads=rng.choice([1, 2, 8]),
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    check(case)


@pytest.mark.parametrize("num_decodes", [1, 40, 200])
@gpu
def test_gpu_mixed_step_as_the_executor_orders_it(rng, num_decodes):
    # decodes first (their own launch on decode tiles, split-KV when long), then prompts
    subseqs = [SubSeq(i, 1, rng.randint(1, 4000)) for i in range(num_decodes)]
    subseqs += [SubSeq(num_decodes, rng.randint(65, 600), rng.randint(700, 3000))]
    subseqs += prefix_recompute(rng, num_decodes + 1, 2300)
    case = make_case(
        rng, subseqs, block_size=32, num_kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16
    )
    assert case.meta.split_singles() is not None
    check(case)


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(16, torch.bfloat16), (32, torch.float16), (256, torch.bfloat16), (256, torch.float32)],
)
@gpu
def test_gpu_other_head_dims(rng, head_dim, dtype):
    subseqs = random_subseqs(rng, 6, max_query=200, max_context=1500)
    case = make_case(
        rng, subseqs, block_size=32, num_kv_heads=2, group=4, head_dim=head_dim, dtype=dtype
    )
    check(case)


@pytest.mark.parametrize(("batch", "query_len"), [(64, 1), (32, 8), (3, 1)])
@gpu
def test_gpu_long_context_decode(rng, batch, query_len):
    subseqs = [SubSeq(i, query_len, rng.randint(2000, 20000)) for i in range(batch)]
    case = make_case(
        rng, subseqs, block_size=32, num_kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16
    )
    check(case)


@gpu
def test_gpu_prefill_over_cached_context(rng):
    subseqs = [SubSeq(0, 2048, 6144)]
    case = make_case(
        rng, subseqs, block_size=32, num_kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16
    )
    check(case)


def test_a_mixed_steps_rest_does_not_point_into_the_decodes_tensors():
    """Its tensors must start 16-byte aligned whatever the number of decodes: Triton compiles a
    new variant of the kernel for each alignment of a pointer it is given."""
    for decodes in range(1, 6):
        meta = build_metadata(
            [1] * decodes + [3], [9] * decodes + [12], [[0, 1, 2]] * (decodes + 1), 4
        )
        _, rest = meta.split_singles()
        for tensor in (rest.cu_query_lens, rest.seq_lens, rest.block_tables, rest.slot_mapping):
            assert tensor.data_ptr() % 16 == 0, (decodes, tensor)


def test_every_variant_compiles_ahead(monkeypatch):
    """compile_variants launches each tile shape unsplit and split into each power of two of
    splits a context of max_context can take."""
    from pensieve.kernels import triton_attention

    seen: set[tuple] = set()
    real = triton_attention.paged_attention_triton

    def record(query, cache, meta, scale, *, config=None, out=None):
        splits = config.num_splits(meta.max_seq_len)
        seen.add((config.block_m, config.block_n, splits, meta.max_query_len == 1))
        return real(query, cache, meta, scale, config=config, out=out)

    monkeypatch.setattr(triton_attention, "paged_attention_triton", record)
    launches = triton_attention.compile_variants(
        8, 2, 16, 4, 2048, torch.float32, torch.device(DEVICE)
    )
    assert launches == len(seen)
    # decodes split down to 2 tiles (64 positions each): 2048 // 128 = 16 splits at most
    assert {s for _, _, s, _ in seen} == {1, 2, 4, 8, 16}
    decode = choose_config(
        1, 1, 1, 1024, 4, 2, 16, 4, triton_attention._num_sms(torch.device(DEVICE))
    )
    for splits in (1, 2, 4, 8, 16):  # the decode shape, with one token per sub-sequence and several
        assert (decode.block_m, decode.block_n, splits, True) in seen
        assert (decode.block_m, decode.block_n, splits, False) in seen


@gpu
def test_gpu_steps_compile_nothing_after_start_up(rng):
    """compile_variants at start-up covers every step the executor can build: decodes alone and
    with a prompt, any number of sub-sequences (so the metadata's views into its one uploaded
    buffer start at every alignment), short and split long contexts. A shape no other test uses
    (group 2, 3 KV heads, head_dim 64, fp16), so nothing was compiled for it before."""
    from pensieve.kernels.compile_log import CompileLog
    from pensieve.kernels.triton_attention import compile_variants

    shape = {"block_size": 32, "num_kv_heads": 3, "group": 2, "head_dim": 64}
    compile_variants(6, 3, 64, 32, 4096, torch.float16, torch.device("cuda"))
    with CompileLog() as log:
        for num_seqs in range(1, 10):
            subseqs = [SubSeq(i, 1, rng.randint(1, 4096)) for i in range(num_seqs)]
            if num_seqs % 2:
                prompt = rng.randint(2, 400)
                subseqs.append(SubSeq(num_seqs, prompt, prompt + rng.randint(0, 3000)))
            case = make_case(rng, subseqs, dtype=torch.float16, **shape)
            paged_attention_triton(case.query, case.kv_cache, case.meta, case.scale)
        torch.cuda.synchronize()
    attention = [e for e in log.events if "attention" in e.kernel or "merge" in e.kernel]
    assert not attention, [(e.kernel, e.detail) for e in attention]
