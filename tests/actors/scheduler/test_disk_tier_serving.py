"""The disk tier in serving, with the real SmolLM2 on the CPU (fp32), real files and LMDB in
`tmp_path`: tiny GPU and CPU tiers push chunks down to disk, and a turn's greedy tokens are the
same whether its history comes from the GPU, the CPU tier, the disk or recomputation; after a
clean stop a restarted engine reads the history back from disk; a corrupted chunk is recomputed;
a full disk budget keeps serving, and keeps the chunks of highest retention value; a file
system that fills up turns writes off and serving goes on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import pytest

from pensieve.actors.scheduler.engine import READ_WAIT_S, Engine
from pensieve.actors.scheduler.request import Request, TokenSources
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.step import SamplingParams
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from tests.ops.test_disk_full import small_disk

pytestmark = pytest.mark.slow

BLOCK = 32
# 8 GPU blocks and 2 CPU slots: each long prompt evicts what is idle down the tiers
TINY = dict(gpu_cache_tokens=8 * BLOCK, cpu_cache_tokens=2 * BLOCK, admission_reserve=0.0)
ROOMY = dict(gpu_cache_tokens=64 * BLOCK, cpu_cache_tokens=64 * BLOCK)
# a CPU tier where chunks stay a few steps before the next prompts evict them
MIDDLE = dict(gpu_cache_tokens=8 * BLOCK, cpu_cache_tokens=6 * BLOCK, admission_reserve=0.0)
FAST_DISK = 1e6  # GB/s: every chunk on disk is read back rather than recomputed
SLOW_DISK = 1e-6  # GB/s: every chunk is cheaper to recompute than to read back
OPENINGS = {
    "a": "Tell me about the harbour of Lyon and its old bridges over the river. " * 7,
    "b": "Describe a morning at a bakery in a small town by the sea, step by step. " * 7,
    "c": "Write about two cats on a boat and the storm they sail through at night. " * 7,
}
NEXT = {"a": "And the museums?", "b": "What do they bake at noon?", "c": "How does it end?"}
# a new conversation that opens as "a" did: its prefix found by content (on disk when a's is)
LATE = ("d", OPENINGS["a"] + "Answer briefly.")


@pytest.fixture(scope="module")
def roomy(smollm2, chat) -> Run:
    """The conversations on tiers that hold them all: every history from the GPU."""
    return conversations(engine(smollm2, chat, ROOMY))


@dataclass
class Run:
    engine: Engine
    chat: ChatTokenizer
    logs: dict[str, list[int]] = field(default_factory=dict)
    turns: list[Request] = field(default_factory=list)

    def turn(self, conv_id: str, text: str) -> Request:
        prompt = self.logs.get(conv_id, []) + self.chat.encode(text)
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        request = self.engine.add_request(conv_id, prompt, sampling)
        while self.engine.has_work():
            self.engine.step()
            self.engine.kv.check_invariants()
        assert request.finish_reason is not None and request.error is None
        self.logs[conv_id] = request.all_ids
        self.turns.append(request)
        return request

    def outputs(self) -> list[list[int]]:
        return [r.output_ids for r in self.turns]

    def sources(self) -> TokenSources:
        return sum((r.sources for r in self.turns), TokenSources())


def engine(
    smollm2, chat, tiers: dict, disk: Path | None = None, gb: float = 0.1, read_gbps=FAST_DISK
) -> Run:
    options = EngineOptions(
        model="smollm2",
        max_batch_tokens=512,
        disk_cache_dir=None if disk is None else str(disk),
        disk_cache_gb=None if disk is None else gb,
        disk_read_gbps=read_gbps,
        **tiers,
    )
    return Run(assemble(options, smollm2, chat).engine, chat)


def conversations(run: Run) -> Run:
    """Three conversations of two turns each, interleaved, and a fourth that opens as the first
    did: with tiny tiers each one's history is pushed off the GPU and the CPU tier by the
    others' before its second turn."""
    for conv_id, text in OPENINGS.items():
        run.turn(conv_id, text)
    run.turn(*LATE)
    for conv_id, text in NEXT.items():
        run.turn(conv_id, text)
    return run


def test_greedy_tokens_are_the_same_from_gpu_cpu_disk_and_recomputation(
    smollm2, chat, roomy, tmp_path
) -> None:
    recomputed = conversations(engine(smollm2, chat, TINY))
    on_disk = conversations(engine(smollm2, chat, TINY, tmp_path))
    assert on_disk.outputs() == roomy.outputs() == recomputed.outputs()
    assert roomy.sources().gpu > 0 and roomy.sources().recomputed == 0
    assert recomputed.sources().recomputed >= 4 * BLOCK and recomputed.sources().disk == 0
    # the second turns' histories came back from disk, in place of most of the recomputing
    disk = on_disk.sources()
    assert disk.disk >= 4 * BLOCK, disk
    assert disk.recomputed < recomputed.sources().recomputed
    stats = on_disk.engine.stats()["tokens"]["prompt_sources"]
    assert stats["disk"] == disk.disk
    on_disk.engine.disk.close()


def test_chunks_are_saved_for_the_disk_while_on_the_cpu_tier_ahead_of_their_eviction(
    smollm2, chat, roomy, tmp_path
) -> None:
    """A chunk saved as it leaves the CPU tier is copied out of its slot on the step's path
    (the same step reuses the slot); one saved earlier, while it sits there, by the writer."""
    run = conversations(engine(smollm2, chat, MIDDLE, tmp_path))
    assert run.outputs() == roomy.outputs()
    saves = run.engine.stats()["cache"]["disk_saves"]
    assert saves["ahead"] > 2 * saves["on_eviction"], saves
    assert run.sources().disk >= 4 * BLOCK
    assert run.engine.stats()["cache"]["disk_saves"] is not None
    run.engine.disk.close()
    assert roomy.engine.stats()["cache"]["disk_saves"] is None


def test_chunks_cheaper_to_recompute_than_to_read_are_not_saved_while_serving(
    smollm2, chat, roomy, tmp_path
) -> None:
    """On a disk that reads slower than the model recomputes, serving writes nothing (it would
    never be read back); a clean stop still writes the tiers back."""
    run = conversations(engine(smollm2, chat, MIDDLE, tmp_path, read_gbps=SLOW_DISK))
    assert run.outputs() == roomy.outputs()
    saves = run.engine.stats()["cache"]["disk_saves"]
    assert saves["ahead"] == saves["on_eviction"] == 0, saves
    assert saves["not_worth_reading"] >= 4, saves
    assert run.sources().disk == 0 and run.sources().recomputed >= 4 * BLOCK
    assert run.engine.disk.num_saved == 0
    assert run.engine.write_back() > 0
    run.engine.disk.close()


def first_turns(smollm2, chat, tiers: dict, disk: Path) -> Run:
    """Each conversation's first turn, then a clean stop: the tiers written back, the tier
    closed."""
    run = engine(smollm2, chat, tiers, disk)
    for conv_id, text in OPENINGS.items():
        run.turn(conv_id, text)
    assert run.engine.write_back() > 0
    run.engine.disk.close()
    return run


def restarted(smollm2, chat, before: Run, disk: Path) -> Run:
    """A fresh engine on the same directory, knowing the conversations from their token logs
    only (as after a restart), running the fourth conversation and each one's second turn."""
    run = engine(smollm2, chat, ROOMY, disk)
    for conv_id, log in before.logs.items():
        run.engine.restore(conv_id, log)
        run.logs[conv_id] = log
    run.turn(*LATE)
    for conv_id, text in NEXT.items():
        run.turn(conv_id, text)
    run.engine.disk.close()
    return run


def test_a_restarted_engine_reads_the_history_from_disk(smollm2, chat, roomy, tmp_path) -> None:
    reference = roomy.outputs()
    before = first_turns(smollm2, chat, ROOMY, tmp_path)  # every chunk on the GPU at the stop
    after = restarted(smollm2, chat, before, tmp_path)
    assert before.outputs() + after.outputs() == reference
    history = sum(len(log) - 1 for log in before.logs.values())
    assert after.sources().disk >= history // BLOCK * BLOCK - 3 * BLOCK, after.sources()
    late = after.turns[0].sources
    assert late.disk >= 3 * BLOCK and late.new < BLOCK, late  # all of a's full chunks, by key


def test_a_corrupted_chunk_on_disk_is_recomputed(smollm2, chat, roomy, tmp_path) -> None:
    reference = roomy.outputs()
    before = first_turns(smollm2, chat, ROOMY, tmp_path)
    slots = tmp_path / "rank0" / "slots.bin"
    data = bytearray(slots.read_bytes())
    for offset in range(1000, len(data), 4096):  # a flipped byte in every page of every slot
        data[offset] ^= 0xFF
    slots.write_bytes(bytes(data))
    after = restarted(smollm2, chat, before, tmp_path)
    assert before.outputs() + after.outputs() == reference
    assert after.sources().disk == 0
    assert after.sources().recomputed >= 4 * BLOCK


def test_a_full_disk_budget_keeps_serving_with_the_same_tokens(
    smollm2, chat, roomy, tmp_path
) -> None:
    chunk = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2 in fp32: 30 layers of K and V, 3 heads of 64
    small = conversations(engine(smollm2, chat, TINY, tmp_path, gb=3.5 * chunk / (1 << 30)))
    assert small.outputs() == roomy.outputs()
    tier = small.engine.disk.tier
    assert tier.num_slots == 3 and tier.num_chunks <= 3
    assert small.engine.disk.num_written > tier.num_slots  # older chunks made room for newer
    small.engine.disk.close()


# a long conversation first, then short ones that push its chunks down the tiers; the clock
# stands still, so every chunk's retention value is Cost(l) of its last position (all users
# alike idle) and does not change with time: the disk must keep the deepest chunks offered
LONG = ("long", "Tell me about the harbour of Lyon and its old bridges over the river. " * 24)
SHORT = [(conv_id, text) for conv_id, text in OPENINGS.items()] + [
    ("e", "List the rivers of France from the longest to the shortest, with a line each. " * 7),
    ("f", "Explain how a lighthouse keeper spends the long winter nights on the island. " * 7),
]
STILL = dict(gpu_cache_tokens=16 * BLOCK, cpu_cache_tokens=2 * BLOCK, admission_reserve=0.0)
NUM_DISK_SLOTS = 5


def values(
    run: Run, now: float
) -> tuple[list[tuple[float, str, int]], list[tuple[float, str, int]]]:
    """The retention values `Cost(l) * sum over users of 1/T` of the sealed chunks on disk, and
    of those dropped from every tier (computed here from the conversations)."""
    kv, tier = run.engine.kv, run.engine.disk.tier
    on_disk, dropped = [], []
    for conv in kv.conversations.values():
        for i, key in enumerate(conv.keys[: len(conv.chunks)]):
            chunk = conv.chunks[i]
            users = chunk.users.values()
            value = kv.cost((i + 1) * BLOCK) * sum(
                1 / max(now - u.last_active, 1e-6) for u in users
            )
            if key in tier:
                on_disk.append((value, conv.conv_id, i))
            elif kv.place(chunk) == 0:
                dropped.append((value, conv.conv_id, i))
    return on_disk, dropped


def test_the_disk_keeps_the_chunks_of_highest_retention_value_within_its_budget(
    smollm2, chat, tmp_path
) -> None:
    chunk = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2 in fp32
    gb = (NUM_DISK_SLOTS + 0.5) * chunk / (1 << 30)
    reference = engine(smollm2, chat, STILL)
    run = engine(smollm2, chat, STILL, tmp_path, gb=gb)
    now = 1000.0
    for each in (reference, run):
        each.engine.clock = lambda: now
    tier = run.engine.disk.tier
    slots = tmp_path / "rank0" / "slots.bin"
    for conv_id, text in [LONG, *SHORT]:
        reference.turn(conv_id, text)
        run.turn(conv_id, text)
        run.engine.disk.flush()
        assert tier.num_slots == NUM_DISK_SLOTS and tier.num_chunks <= NUM_DISK_SLOTS
        assert slots.stat().st_size == NUM_DISK_SLOTS * tier.geometry.slot_bytes
    kept, dropped = values(run, now)
    assert len(kept) == NUM_DISK_SLOTS and dropped, (kept, dropped)
    assert min(kept)[0] >= max(dropped)[0], (sorted(kept), sorted(dropped))
    assert run.engine.disk.num_saved > NUM_DISK_SLOTS  # more chunks were offered than fit
    # every conversation goes on with the tokens of a run without the disk tier
    for conv_id, _ in [LONG, *SHORT]:
        reference.turn(conv_id, NEXT.get(conv_id, "Go on."))
        run.turn(conv_id, NEXT.get(conv_id, "Go on."))
    assert run.outputs() == reference.outputs()
    assert run.sources().disk > 0 and reference.sources().disk == 0
    run.engine.disk.close()
    index = lmdb.open(str(tmp_path / "rank0" / "index"), max_dbs=2, readonly=True)
    with index, index.begin() as txn:
        assert txn.stat(index.open_db(b"chunks", txn=txn))["entries"] <= NUM_DISK_SLOTS


def test_a_file_system_that_fills_up_turns_writes_off_and_serving_goes_on(
    smollm2, chat, roomy, tmp_path, caplog
) -> None:
    """A real ENOSPC: the tier on an 8 MiB tmpfs (room for 5 chunks) under a budget of 70."""
    with small_disk(tmp_path / "disk", "8m") as mount:
        run = engine(smollm2, chat, TINY, mount, gb=0.1)
        cache = run.engine.disk
        writes_off: list[int] = []  # chunks on disk after each turn once writes are off
        for conv_id, text in [*OPENINGS.items(), LATE, *NEXT.items()]:
            run.turn(conv_id, text)
            cache.flush()
            if not cache.writable:
                writes_off.append(cache.tier.num_chunks)
        assert run.outputs() == roomy.outputs()
        off = [r for r in caplog.records if "writes are off" in r.getMessage()]
        assert len(off) == 1 and "No space left on device" in off[0].getMessage(), off
        assert len(writes_off) >= 3 and cache.tier.num_slots > 50
        assert 0 < cache.tier.num_chunks * cache.tier.geometry.slot_bytes < 8 << 20
        # once off: nothing is written, nor removed to make room for writes that never come
        assert len(set(writes_off)) == 1
        assert run.engine.kv.disk is not None and not run.engine.kv.disk.writable
        assert run.sources().recomputed > roomy.sources().recomputed
        cache.close()


def test_a_turn_waiting_for_its_disk_read_is_waited_for_not_stepped_around(
    smollm2, chat, tmp_path
) -> None:
    """With nothing else to run, a step waits for the read (up to READ_WAIT_S) rather than the
    engine stepping for nothing, which would hold the interpreter the read threads need."""
    before = first_turns(smollm2, chat, ROOMY, tmp_path)
    run = engine(smollm2, chat, ROOMY, tmp_path)
    for conv_id, log in before.logs.items():
        run.engine.restore(conv_id, log)
    engine_ = run.engine
    steps, waited = 0, 0.0
    for conv_id, text in NEXT.items():
        prompt = before.logs[conv_id] + chat.encode(text)
        request = engine_.add_request(conv_id, prompt, SamplingParams(max_tokens=2))
        while engine_.has_work():
            reading = any(
                r.disk_read is not None and not r.disk_read.done()
                for r in engine_.scheduler.waiting
            )
            began = time.perf_counter()
            engine_.step()
            if reading:
                steps += 1
                waited += time.perf_counter() - began
        assert request.error is None and request.sources.disk > 0
    assert steps > 0, "no step found a read in progress"
    assert steps <= waited / READ_WAIT_S + len(NEXT), (steps, waited)
    assert engine_.num_read_waits > 0
    engine_.disk.close()
