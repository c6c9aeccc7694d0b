"""Step time and decode tokens/s of one batch with none, a quarter or all of its requests under a
JSON schema (grammar-constrained sampling, `actors/executor/grammar.py`), on the engine itself:

    python -m benchmarks.structured_output --model preset:llama3.1-8b --device cuda \\
        --dtype bfloat16 --tokenizer .bench/tokenizer [--batch 64] [--fractions 0,0.25,1] \\
        [--backends llguidance,xgrammar]

Every configuration runs the same batch (the same prompts, `--max-tokens` tokens each, end of
sequence ignored) and times its decode steps; the schema asks for a long array of nested objects
(enums, integers, strings), so a constrained reply stays inside the grammar for every token.
`--backends` builds the masks with each library in turn (xgrammar through
`benchmarks/xgrammar_masks.py`, installed apart: it is no dependency), and times the host's
mask work of each step beside the step. The last lines are a table: per library and fraction,
the median decode step, the median mask work of a step, decode tokens/s, each step against 0%,
and whether every constrained reply is one the schema allows (checked with llguidance).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import llguidance.hf
from llguidance import LLMatcher

from benchmarks.xgrammar_masks import TimedMasks, XGrammarMasks
from pensieve.actors.executor.grammar import GrammarMasks
from pensieve.actors.executor.model_runner import ModelRunner
from pensieve.actors.scheduler.engine import Engine
from pensieve.actors.wire.step import SamplingParams
from pensieve.actors.wire.structured import Grammar
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import build

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
    backend: str
    fraction: float
    constrained: int
    step_ms: float  # median decode step
    mask_ms: float  # median host mask work of a decode step with constrained rows (0: none)
    tokens_per_s: float  # decode tokens over the decode steps' wall time
    valid: bool  # every constrained reply is a prefix the grammar allows (the sampler obeyed)


def run(
    engine: Engine,
    masks: TimedMasks,
    tokenizer: Any,
    prompts: list[list[int]],
    max_tokens: int,
    fraction: float,
    backend: str = "llguidance",
) -> Result:
    """One batch of `prompts`, the first `fraction` of them under the schema, the masks built
    by `masks` (the engine's executor's); `tokenizer`: llguidance's, to check the constrained
    replies."""
    grammar = Grammar.json_schema(SCHEMA)
    num = round(len(prompts) * fraction)
    requests = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, grammar=grammar if i < num else None
        )
        requests.append(engine.add_request(f"f{fraction}-{i}", prompt, sampling))
    steps: list[float] = []
    mask_s: list[float] = []
    tokens = 0
    while engine.has_work():
        masks.seconds.clear()
        begin = time.perf_counter()
        outcome = engine.step()
        took = time.perf_counter() - begin
        timing = engine.last_timing
        if timing is not None and timing.kind == "decode" and timing.decodes == len(prompts):
            steps.append(took)
            mask_s.append(sum(masks.seconds))
            tokens += len(outcome.new_tokens)
    for request in requests:
        engine.forget(request.conv_id)
    valid = all(_allowed(tokenizer, r.output_ids) for r in requests[:num])
    wall = sum(steps)
    return Result(
        backend,
        fraction,
        num,
        1e3 * statistics.median(steps),
        1e3 * statistics.median(mask_s),
        tokens / wall,
        valid,
    )


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
    parser.add_argument("--backends", default="llguidance", help="llguidance and/or xgrammar")
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    backends = args.backends.split(",")
    if set(backends) - {"llguidance", "xgrammar"}:
        parser.error("--backends: llguidance and/or xgrammar")
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
    runner = engine.runner
    if not isinstance(runner, ModelRunner):
        raise SystemExit("the benchmark needs the engine's model runner in this process")
    results: list[Result] = []
    for backend in backends:
        masks = TimedMasks(_masks(backend, chat, built.loaded.config.vocab_size))
        runner.grammars = masks  # type: ignore[assignment]
        # warm up: graphs, the grammar tokenizer and compiled schema
        run(engine, masks, tokenizer, prompts[: min(8, args.batch)], 8, 0.5, backend)
        results += [
            run(engine, masks, tokenizer, prompts, args.max_tokens, f, backend) for f in fractions
        ]
    print(f"# {args.model} on {args.device} ({args.dtype}): batch {args.batch}, ", end="")
    print(f"prompt {args.prompt_tokens} tokens, {args.max_tokens} decode steps")
    print("library     constrained  rows  step ms  mask ms  tokens/s  vs 0%   valid")
    for r in results:
        base = next((b for b in results if b.backend == r.backend and b.constrained == 0), r)
        slower = r.step_ms / base.step_ms - 1
        print(
            f"{r.backend:<10}  {r.fraction:>10.0%}  {r.constrained:>4}  {r.step_ms:>7.2f}"
            f"  {r.mask_ms:>7.2f}  {r.tokens_per_s:>8.0f}  {slower:>+5.1%}"
            f"  {'yes' if r.valid else 'NO'}"
        )
    return 0 if all(r.valid for r in results) else 1


def _masks(backend: str, chat: Any, vocab_size: int) -> GrammarMasks | XGrammarMasks:
    """The executor's grammar masks, built by `backend`."""
    if backend == "xgrammar":
        return XGrammarMasks(chat.tokenizer, chat.eos_token_ids, vocab_size)
    return GrammarMasks.from_hf(chat.tokenizer, chat.eos_token_ids, vocab_size)


if __name__ == "__main__":
    raise SystemExit(main())
