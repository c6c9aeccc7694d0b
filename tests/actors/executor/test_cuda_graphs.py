"""Decode steps replayed from CUDA graphs give the logits of the eager forward (GPU only)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from pensieve.actors.config import CacheConfig
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.wire.step import SamplingParams, SeqPiece, StepPlan
from pensieve.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("batch", [1, 5, 33, 200])
def test_graph_decode_matches_eager(batch):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    loaded = load_model("preset:tiny-llama", "cuda", torch.bfloat16, seed=seed)
    cache = CacheConfig(block_size=16, num_gpu_blocks=max(2048, 60 * batch))
    eager = ModelRunner(
        loaded.model, cache, torch.device("cuda"), torch.bfloat16, cuda_graphs=False
    )
    graphs = ModelRunner(loaded.model, cache, torch.device("cuda"), torch.bfloat16)
    for layer, other in zip(eager.gpu_caches, graphs.gpu_caches, strict=True):
        layer.normal_()
        other.copy_(layer)
    blocks = list(range(cache.num_gpu_blocks))
    random.Random(seed).shuffle(blocks)
    pieces = []
    for i in range(batch):
        length = random.randint(2, 900)
        table = tuple(blocks[i * 60 : i * 60 + -(-length // 16)])
        token = random.randrange(loaded.config.vocab_size)
        pieces.append(SeqPiece(f"r{i}", (token,), length - 1, length, table, SamplingParams(), 0))
    plan = StepPlan(tuple(pieces))
    assert graphs.graphs is not None and graphs.graphs.fits(plan)
    want = eager.logits(plan)
    got = graphs.logits(plan)
    assert got.shape == want.shape == (batch, loaded.config.vocab_size)
    error = ((got - want).norm() / want.norm()).item()
    assert error < 2e-2, f"seed {seed}: relative error {error}"
    # clobber freed memory: a graph that reads a tensor it does not keep alive breaks here
    junk = [
        torch.full((size,), -7, dtype=torch.int32, device="cuda")
        for size in [64] * 4000 + [1 << 20] * 64
    ]
    again = graphs.logits(plan)  # a second replay of the same inputs
    del junk
    assert torch.equal(again, got), f"seed {seed}"


def test_capture_all_leaves_nothing_to_capture_later():
    loaded = load_model("preset:tiny-llama", "cuda", torch.bfloat16, seed=0)
    cache = CacheConfig(block_size=16, num_gpu_blocks=150 * 64)
    runner = ModelRunner(loaded.model, cache, torch.device("cuda"), torch.bfloat16)
    assert runner.graphs is not None
    count = runner.graphs.capture_all(max_batch=150)
    captured = set(runner.graphs.graphs)
    assert len(captured) == count
    assert {batch for batch, _ in captured} == {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160}
    rng = random.Random(0)
    for batch in (1, 7, 150):
        length = rng.randint(2, loaded.config.max_context_len)
        pieces = tuple(
            SeqPiece(
                f"r{i}",
                (3,),
                length - 1,
                length,
                tuple(range(i * 64, i * 64 + 64)),
                SamplingParams(),
                0,
            )
            for i in range(batch)
        )
        runner.logits(StepPlan(pieces))
    assert set(runner.graphs.graphs) == captured


def test_graphs_are_captured_while_another_thread_waits_for_the_device():
    """Other threads wait for the device at any time (the disk tier's writer waits for the copy
    of a chunk it saves): a capture on the engine's thread neither refuses their calls nor
    fails because of them."""
    loaded = load_model("preset:tiny-llama", "cuda", torch.bfloat16, seed=0)
    cache = CacheConfig(block_size=16, num_gpu_blocks=64 * 64)
    runner = ModelRunner(loaded.model, cache, torch.device("cuda"), torch.bfloat16)
    assert runner.graphs is not None
    stop, errors, waits = threading.Event(), [], []
    stream = torch.cuda.Stream()
    source = torch.ones(1 << 20, device="cuda")
    target = torch.empty(1 << 20, pin_memory=True)

    def writer() -> None:
        try:
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    target.copy_(source, non_blocking=True)
                    event = stream.record_event()
                event.synchronize()
                waits.append(1)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for batch in (1, 3, 6, 12, 20, 40, 60):  # a capture each: every batch a new bucket
            pieces = tuple(
                SeqPiece(
                    f"r{i}", (3,), 99, 100, tuple(range(i * 64, i * 64 + 7)), SamplingParams(), 0
                )
                for i in range(batch)
            )
            runner.logits(StepPlan(pieces))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert waits
    assert len(runner.graphs.graphs) == 7


def test_graphs_captured_at_start_up_serve_every_step_and_share_one_logits_buffer():
    """`capture_graphs` leaves nothing to capture while serving (no step stalls on a capture):
    decodes of any batch and context the tier holds, steps with prefill of any size up to the
    token budget. Every decode graph writes its logits into one buffer, and what each replays
    is still the eager forward's."""
    seed = random.randrange(1 << 30)
    loaded = load_model("preset:tiny-llama", "cuda", torch.bfloat16, seed=seed)
    cache = CacheConfig(block_size=16, num_gpu_blocks=40 * 64)
    device = torch.device("cuda")
    runner = ModelRunner(loaded.model, cache, device, torch.bfloat16)
    eager = ModelRunner(loaded.model, cache, device, torch.bfloat16, cuda_graphs=False)
    for layer, other in zip(runner.gpu_caches, eager.gpu_caches, strict=True):
        layer.normal_()
        other.copy_(layer)
    decodes, steps = runner.capture_graphs(max_batch=40, max_tokens=600)
    assert runner.graphs is not None and runner.mixed_graphs is not None
    captured, sizes = set(runner.graphs.graphs), set(runner.mixed_graphs.captured)
    assert (len(captured), len(sizes)) == (decodes, steps)
    buffers = {g.logits.untyped_storage().data_ptr() for g in runner.graphs.graphs.values()}
    assert len(buffers) == 1
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    for batch in (1, 3, 17, 40):
        for longest in (2, 600, loaded.config.max_context_len):
            pieces = tuple(
                SeqPiece(
                    f"r{i}",
                    (rng.randrange(vocab),),
                    end - 1,
                    end,
                    tuple(range(i * 64, i * 64 + 64)),
                    SamplingParams(),
                    0,
                )
                for i, end in enumerate([longest] + [rng.randint(2, longest)] * (batch - 1))
            )
            plan = StepPlan(pieces)
            got, want = runner.logits(plan), eager.logits(plan)
            error = ((got - want).norm() / want.norm()).item()
            assert error < 2e-2, f"seed {seed}, batch {batch}, context {longest}: {error}"
    for tokens in (5, 100, 600):
        prompt = tuple(rng.randrange(vocab) for _ in range(tokens))
        table = tuple(range(64))
        runner.logits(StepPlan((SeqPiece("p", prompt, 0, tokens, table, SamplingParams(), 0),)))
    assert set(runner.graphs.graphs) == captured
    assert set(runner.mixed_graphs.captured) == sizes
