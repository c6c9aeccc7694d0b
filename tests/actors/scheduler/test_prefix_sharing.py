"""Prefix sharing on the engine, with the real SmolLM2 on the CPU (fp32) and tiny tiers: one
workload of conversations over a common prefix gives the same greedy tokens with sharing on and
off, and with sharing on it takes every cache path a shared chunk has (a GPU hit, a CPU hit, the
recompute of a dropped shared chunk, a suspension), checked after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.scheduler.request import Request
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.step import SamplingParams
from pensieve.models.loader import LoadedModel
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble

BLOCK = 32
# 8 GPU blocks and 4 CPU slots: a long prompt evicts all that is idle, and some of it is dropped
TIERS = dict(gpu_cache_tokens=8 * BLOCK, cpu_cache_tokens=4 * BLOCK, admission_reserve=0.0)
SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in two sentences, name the "
    "country of every city you mention, and never invent opening hours or prices. "
)


@dataclass
class Run:
    engine: Engine
    chat: ChatTokenizer
    logs: dict[str, list[int]] = field(default_factory=dict)  # conversation -> its token log
    turns: list[Request] = field(default_factory=list)

    def wave(self, turns: dict[str, str], max_tokens: int = 4) -> list[Request]:
        """Start the turns together (each conversation's log, then `text`), step until all
        have ended, checking the cache after every step."""
        started = []
        for conv_id, text in turns.items():
            prompt = self.logs.get(conv_id, []) + self.chat.encode(text)
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            started.append(self.engine.add_request(conv_id, prompt, sampling))
        while self.engine.has_work():
            self.engine.step()
            self.engine.kv.check_invariants()
        for request in started:
            assert request.finish_reason is not None and request.error is None
            self.logs[request.conv_id] = request.all_ids
        self.turns += started
        return started


def workload(smollm2: LoadedModel, chat: ChatTokenizer, sharing: bool) -> Run:
    options = EngineOptions(model="smollm2", prefix_sharing=sharing, max_batch_tokens=512, **TIERS)
    run = Run(assemble(options, smollm2, chat).engine, chat)
    prefix = SYSTEM * 2  # about 3 chunks, common to every conversation below
    run.wave({"a": prefix + "Where is Lyon?"})
    run.wave({"b": prefix + "Where is Porto?"})  # a's prefix, live on the GPU
    run.wave({"x": "Tell me a long story about a lighthouse keeper. " * 21})  # evicts a and b
    run.wave({"c": prefix + "Where is Graz?"})  # the prefix, from the CPU tier
    run.wave({"y": "A second long story, about a baker in a small town. " * 19})
    run.wave({"z": "And a third one, about two cats on a boat at sea. " * 14})
    run.wave({"b": "And Braga?"})  # its history, the shared prefix dropped meanwhile
    # three at once, each growing past what the GPU holds for all: one is suspended
    run.wave({f"s{i}": prefix + f"Plan day {i} of a trip to Spain." for i in range(3)}, 56)
    return run


def test_greedy_tokens_are_the_same_with_and_without_sharing_on_every_cache_path(
    smollm2, chat
) -> None:
    shared = workload(smollm2, chat, sharing=True)
    alone = workload(smollm2, chat, sharing=False)
    assert [r.output_ids for r in shared.turns] == [r.output_ids for r in alone.turns]
    by_turn = {(r.conv_id, r.num_suspensions > 0): r.sources for r in shared.turns}
    a, b1, _, c, _, _, b2 = (r.sources for r in shared.turns[:7])
    assert a.shared == 0 and b1.shared >= 2 * BLOCK and b1.gpu >= b1.shared  # a GPU hit
    assert c.shared >= 2 * BLOCK and c.cpu >= 2 * BLOCK  # a new conversation: from the CPU tier
    assert b2.recomputed >= 2 * BLOCK  # its shared prefix was dropped: recomputed
    assert shared.engine.num_suspensions > 0, "no turn was suspended"
    assert any(r.num_suspensions and r.sources.shared for r in shared.turns), by_turn
    # without sharing nothing is found by content, and the prefix is computed once per turn
    assert all(r.sources.shared == 0 for r in alone.turns)
    assert alone.turns[1].sources.gpu == 0
    stats = shared.engine.stats()["prefix_cache"]
    assert stats["shared_hits"] == sum(r.sources.shared for r in shared.turns) > 0
    assert stats["hits"] > alone.engine.stats()["prefix_cache"]["hits"]
