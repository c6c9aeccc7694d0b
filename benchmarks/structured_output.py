"""Step time and decode tokens/s of one batch with none, a quarter or all of its requests under a
JSON schema (grammar-constrained sampling, `actors/executor/grammar.py`), on the engine itself:

    python -m benchmarks.structured_output --model preset:llama3.1-8b --device cuda \\
        --dtype bfloat16 --tokenizer .bench/tokenizer [--batch 64] [--fractions 0,0.25,1]

Every configuration runs the same batch (the same prompts, `--max-tokens` tokens each, end of
sequence ignored) and times its decode steps; the schema asks for a long array of nested objects
(enums, integers, strings), so a constrained reply stays inside the grammar for every token. The
last lines are a table: the median decode step, decode tokens/s, and each against 0%.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import llguidance.hf
from llguidance import LLMatcher

from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.wire.step import SamplingParams
from pensieve.actors.wire.structured import Grammar
from pensieve.ops.factory import EngineOptions, build

SCHEMA = {
    "type": "object",
    "properties": {
        "readings": {
            "type": "array",
            "minItems": 1000,  # longer than any reply here: the grammar never lets one end
            "items": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                    "temperature_c": {"type": "integer"},
                    "alerts": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                },
                "required": ["city", "sky", "temperature_c", "alerts"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["readings"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Result:
    fraction: float
    constrained: int
    step_ms: float  # median decode step
    tokens_per_s: float  # decode tokens over the decode steps' wall time
    valid: bool  # every constrained reply is a prefix the grammar allows (the sampler obeyed)


def run(
    engine: Engine, tokenizer: Any, prompts: list[list[int]], max_tokens: int, fraction: float
) -> Result:
    """One batch of `prompts`, the first `fraction` of them under the schema; `tokenizer`:
    llguidance's, to check the constrained replies."""
    grammar = Grammar.json_schema(SCHEMA)
    num = round(len(prompts) * fraction)
    requests = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, grammar=grammar if i < num else None
        )
        requests.append(engine.add_request(f"f{fraction}-{i}", prompt, sampling))
    steps: list[float] = []
    tokens = 0
    while engine.has_work():
        begin = time.perf_counter()
        outcome = engine.step()
        took = time.perf_counter() - begin
        timing = engine.last_timing
        if timing is not None and timing.kind == "decode" and timing.decodes == len(prompts):
            steps.append(took)
            tokens += len(outcome.new_tokens)
    for request in requests:
        engine.forget(request.conv_id)
    valid = all(_allowed(tokenizer, r.output_ids) for r in requests[:num])
    wall = sum(steps)
    return Result(fraction, num, 1e3 * statistics.median(steps), tokens / wall, valid)


def _allowed(tokenizer: Any, output: list[int]) -> bool:
    """Whether the grammar accepts `output` as a start (checked with a fresh matcher)."""
    matcher = LLMatcher(tokenizer, Grammar.json_schema(SCHEMA).compiled(), log_level=0)
    return bool(matcher.consume_tokens(output)) and not matcher.is_error()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fractions", default="0,0.25,1")
    parser.add_argument("--gpu-cache-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    need = args.batch * (args.prompt_tokens + args.max_tokens + 32)
    options = EngineOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        gpu_cache_tokens=args.gpu_cache_tokens or need,
        cpu_cache_tokens=0,
        max_num_seqs=max(args.batch, 1),
        max_batch_tokens=max(args.batch * args.prompt_tokens, 512),
        prefix_sharing=False,
    )
    built = build(options)
    engine, chat = built.engine, built.chat
    if built.loaded.config.vocab_size < len(chat.tokenizer):
        raise SystemExit(
            f"the model's vocabulary ({built.loaded.config.vocab_size} tokens) is smaller than "
            f"the tokenizer's ({len(chat.tokenizer)}): the schema needs tokens it cannot write"
        )
    text = "Report the weather of many cities as JSON readings, one object per city. " * 40
    ids = chat.encode(text)
    # distinct prompts: no request reuses another's KV
    prompts = [[i + 1, *ids[: args.prompt_tokens - 1]] for i in range(args.batch)]
    tokenizer = llguidance.hf.from_tokenizer(chat.tokenizer)
    # warm up: graphs, the executor's grammar tokenizer
    run(engine, tokenizer, prompts[: min(8, args.batch)], 8, 0.5)
    results = [run(engine, tokenizer, prompts, args.max_tokens, f) for f in fractions]
    base = next((r for r in results if r.constrained == 0), results[0])
    print(f"# {args.model} on {args.device} ({args.dtype}): batch {args.batch}, ", end="")
    print(f"prompt {args.prompt_tokens} tokens, {args.max_tokens} decode steps")
    print("constrained  rows  step ms  tokens/s  vs 0%   valid")
    for r in results:
        slower = r.step_ms / base.step_ms - 1
        print(
            f"{r.fraction:>10.0%}  {r.constrained:>4}  {r.step_ms:>7.2f}  {r.tokens_per_s:>8.0f}"
            f"  {slower:>+5.1%}  {'yes' if r.valid else 'NO'}"
        )
    return 0 if all(r.valid for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
