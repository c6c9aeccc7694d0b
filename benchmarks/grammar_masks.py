"""The host's grammar-mask work alone, llguidance against xgrammar, without a model:

    python -m benchmarks.grammar_masks [--tokenizer DIR] [--batch 1,16,64] [--steps 128] \\
        [--backends llguidance,xgrammar]

Each of `--batch` requests is under `benchmarks/structured_output.py`'s JSON schema and
"samples" the tokens of one document the schema allows, one token a step, through the executor's
mask interface (`masks`, then `sampled`): per step, the matchers behind take the previous
step's token and every row's mask is filled, on each library's own threads. The mask work runs
on the host whatever the device, so this measures what `structured_output.py` reports as a
step's mask work, apart from the forward it overlaps. The last lines are a table: per library
and batch, the median and p90 of a step's mask work and its cost per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from transformers import AutoTokenizer

from benchmarks.structured_output import SCHEMA
from benchmarks.xgrammar_masks import XGrammarMasks
from pensieve.actors.executor.grammar import GrammarMasks
from pensieve.actors.wire.step import SamplingParams, SeqPiece
from pensieve.actors.wire.structured import JSON_OPTIONS, Grammar
from pensieve.models.assets import smollm2_tokenizer


class Sampled:
    """One step's sampled tokens: the same token for every row."""

    def __init__(self, token: int, rows: int) -> None:
        self.tokens = [token] * rows

    def host_tokens(self) -> list[int]:
        return self.tokens


def document(num_tokens: int, tokenizer: Any) -> list[int]:
    """The tokens of a reply the schema allows, at least `num_tokens` long (its start)."""
    skies = ["sunny", "cloudy", "rainy", "snowy"]
    readings = [
        {"city": f"City{i}", "sky": skies[i % 4], "temperature_c": i - 7, "alerts": ["wind"]}
        for i in range(num_tokens)
    ]
    text = json.dumps(
        {"readings": readings},
        separators=(JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"]),
    )
    return list(tokenizer.encode(text, add_special_tokens=False))[:num_tokens]


def measure(masks: Any, tokens: list[int], batch: int, name: str = "r") -> list[float]:
    """Seconds of each step's mask work for `batch` requests (ids `name`0, `name`1, ...) taking
    `tokens` one a step; the matchers of other requests are forgotten first."""
    sampling = SamplingParams(max_tokens=len(tokens) + 1, grammar=Grammar.json_schema(SCHEMA))
    seconds = []
    for index, token in enumerate(tokens):
        pieces = [
            SeqPiece(f"{name}{k}", (token,), 100 + index, 101 + index, (), sampling, index)
            for k in range(batch)
        ]
        masks.forget_absent(pieces)
        begin = time.perf_counter()
        found = masks.masks(pieces)
        seconds.append(time.perf_counter() - begin)
        assert found is not None and len(found[0]) == batch
        masks.sampled(Sampled(token, batch), pieces)
    return seconds[1:]  # the first step starts the matchers


def make(backend: str, tokenizer: Any) -> Any:
    eos = [tokenizer.eos_token_id]
    if backend == "llguidance":
        masks = GrammarMasks.from_hf(tokenizer, eos, len(tokenizer))
    elif backend == "xgrammar":
        masks = XGrammarMasks(tokenizer, eos, len(tokenizer))
    else:
        raise SystemExit(f"unknown backend {backend!r}: llguidance or xgrammar")
    return masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (SmolLM2's)")
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--backends", default="llguidance,xgrammar")
    args = parser.parse_args()
    tokenizer = (
        AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else smollm2_tokenizer()
    )
    tokens = document(args.steps, tokenizer)
    rows = []
    for backend in args.backends.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            masks = make(backend, tokenizer)
            measure(masks, tokens[:4], 1, "warm")  # its tokenizer and grammar made untimed
            step = sorted(measure(masks, tokens, batch))
            median, p90 = statistics.median(step), step[int(0.9 * (len(step) - 1))]
            rows.append((backend, batch, 1e3 * median, 1e3 * p90, 1e3 * median / batch))
    print(f"vocabulary {len(tokenizer)}, {len(tokens)} steps")
    print("| library | batch | mask work per step p50 / p90 ms | per row ms |")
    print("|---|---|---|---|")
    for backend, batch, median, p90, per_row in rows:
        print(f"| {backend} | {batch} | {median:.3f} / {p90:.3f} | {per_row:.4f} |")


if __name__ == "__main__":
    main()
