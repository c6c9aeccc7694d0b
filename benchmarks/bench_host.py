"""Host time of the scheduler and the cache manager per step, without a model (CPU only).

A synthetic steady state shaped like the policy benchmark's: the 13B preset's tiers (6144 GPU
blocks, 8192 CPU blocks), the engine's default step budget and cap on running requests, a pool of
900 conversations whose turns come back with random new prompts and replies, 40 waiting at all
times. Steps are scheduled and updated with random sampled tokens; nothing runs on a device.
Schedule and update are not overlapped with the GPU in the engine, so every millisecond of them
is a millisecond of every step; the choice of ahead-of-time swap-outs is (the engine makes it
while the device runs a step).

    python3 -m benchmarks.bench_host [--steps 3000] [--seed 0]

`--streams N` times instead the text work of one step for N streamed replies (ShareGPT replies
through SmolLM2's tokenizer, one token each per step): the scheduler's part (a `TextPiece` per
reply out, the answer applied) and a tokenizer replica's (the pieces followed, messages decoded
and encoded both ways), against decoding each whole reply again every step.

    python3 -m benchmarks.bench_host --streams 256 [--tokens 256]
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from pensieve.actors.config import DEFAULTS, CacheConfig, Policy, SchedulerConfig
from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager
from pensieve.actors.scheduler.request import Request
from pensieve.actors.scheduler.scheduler import Scheduler
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.messages import DetokenizeReply, DetokenizeRequest, TextPiece
from pensieve.actors.wire.step import SamplingParams

STEP_S = 0.03  # simulated time per step (the H200's steady-state step is 25-45 ms)
VOCAB = 32000


def run(steps: int, seed: int, policy: Policy = Policy.PENSIEVE) -> dict[str, float]:
    """Mean schedule and update time per step (ms) over the last two thirds of `steps`."""
    rng = random.Random(seed)
    cache = CacheConfig(DEFAULTS.block_size, 6144, 8192, policy)
    kv = KVCacheManager(cache, cost=lambda context: 1.0 + context / 4096)
    scheduling = SchedulerConfig(DEFAULTS.max_batch_tokens, DEFAULTS.max_num_seqs, 4096)
    scheduler = Scheduler(scheduling, kv)
    histories: dict[str, list[int]] = {}
    idle = [f"c{i}" for i in range(900)]
    now = 0.0
    count = 0

    def send(conv_id: str) -> None:
        nonlocal count
        count += 1
        prompt = histories.get(conv_id, []) + [
            rng.randrange(3, VOCAB) for _ in range(rng.randint(30, 200))
        ]
        sampling = SamplingParams(max_tokens=rng.randint(50, 256), ignore_eos=True)
        scheduler.add(Request(f"{conv_id}#{count}", conv_id, prompt, sampling, now))

    schedule_s = update_s = ahead_s = 0.0
    measured_from = steps // 3
    for step in range(steps):
        now += STEP_S
        if step == measured_from:
            schedule_s = update_s = ahead_s = 0.0
        while len(scheduler.waiting) < 40 and idle:
            conv_id = idle.pop(rng.randrange(len(idle)))
            if len(histories.get(conv_id, [])) < 3000:
                send(conv_id)
        begin = time.perf_counter()
        plan = scheduler.schedule(now)
        schedule_s += time.perf_counter() - begin
        begin = time.perf_counter()
        kv.swap_out_ahead(now)  # the engine does this while the device runs the step
        ahead_s += time.perf_counter() - begin
        sampled = [rng.randrange(3, VOCAB) for piece in plan.pieces if piece.sampling is not None]
        begin = time.perf_counter()
        outcome = scheduler.update(plan, sampled, now)
        update_s += time.perf_counter() - begin
        for request in outcome.finished:
            histories[request.conv_id] = request.all_ids
            idle.append(request.conv_id)
    measured = steps - measured_from
    return {
        "schedule_ms": schedule_s / measured * 1e3,
        "update_ms": update_s / measured * 1e3,
        "swap_out_ahead_ms": ahead_s / measured * 1e3,  # overlapped with the device
        "running": float(len(scheduler.running)),
    }


def follow_cost(chat: ChatTokenizer, streams: int, tokens: int) -> dict[str, float]:
    """Mean text time per step (ms) of `streams` replies growing one token a step: on the
    scheduler, on a tokenizer replica, and for a whole decode of each reply, over `tokens`
    steps."""
    from pensieve.ops.sharegpt import Role, load_conversations

    replies: list[list[int]] = []
    for conv in itertools.islice(load_conversations("sharegpt", 4 * streams), 4 * streams):
        for message in conv.turns:
            ids = chat.encode(message.text) if message.role is Role.GPT else []
            if len(ids) >= tokens and len(replies) < streams:
                replies.append(ids[:tokens])
    if len(replies) < streams:
        raise SystemExit(f"only {len(replies)} replies of {tokens} tokens in the dataset")
    texts, prefixes, reads = [""] * streams, [0] * streams, [0] * streams
    scheduler_s = replica_s = 0.0
    for step in range(1, tokens + 1):
        begin = time.perf_counter()
        pieces = tuple(
            TextPiece(str(i), tuple(ids[prefixes[i] : step]), prefixes[i], prefixes[i], reads[i])
            for i, ids in enumerate(replies)
        )
        body = DetokenizeRequest(pieces).encode()
        sent = time.perf_counter()
        request = DetokenizeRequest.decode(body)
        answer = DetokenizeReply(tuple(map(chat.follow, request.pieces))).encode()
        answered = time.perf_counter()
        for i, update in enumerate(DetokenizeReply.decode(answer).updates):
            texts[i] = texts[i][: len(texts[i]) - update.trim] + update.text
            prefixes[i], reads[i] = update.prefix, update.read
        scheduler_s += (sent - begin) + (time.perf_counter() - answered)
        replica_s += answered - sent
    begin = time.perf_counter()
    for step in range(1, tokens + 1):
        for ids in replies:
            chat.decode(ids[:step])
    whole_s = time.perf_counter() - begin
    assert texts == [chat.decode(ids) for ids in replies]
    per_step = 1e3 / tokens
    return {
        "scheduler_ms": scheduler_s * per_step,
        "replica_ms": replica_s * per_step,
        "whole_ms": whole_s * per_step,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="host time per step of scheduler + cache manager")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streams", type=int, default=0, help="time the text work of N streams")
    p.add_argument("--tokens", type=int, default=256, help="tokens of each streamed reply")
    args = p.parse_args(argv)
    if args.streams:
        from pensieve.models.assets import smollm2_tokenizer

        chat = ChatTokenizer(smollm2_tokenizer(), vocab_size=2**31)
        cost = follow_cost(chat, args.streams, args.tokens)
        print(
            f"per step, {args.streams} streams of {args.tokens} tokens: scheduler "
            f"{cost['scheduler_ms']:.2f} ms, tokenizer replica {cost['replica_ms']:.2f} ms; "
            f"whole-reply decode {cost['whole_ms']:.2f} ms"
        )
        return 0
    result = run(args.steps, args.seed)
    print(
        f"per step: schedule {result['schedule_ms']:.2f} ms, update {result['update_ms']:.2f} ms "
        f"({result['running']:.0f} running at the end); ahead-of-time swap-out choice "
        f"{result['swap_out_ahead_ms']:.2f} ms (the engine overlaps it with the device)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
