"""How often a reply of random tokens streams a chunk of several tokens: uniformly random token
ids (what a model with random weights writes) through the server's own incremental detokenizer
(`ChatTokenizer.follow`), counting the tokens that show no text before each chunk:

    python -m benchmarks.random_text_chunks --tokenizer .bench/tokenizer --model-vocab 128256

The GPU benchmarks run presets of random weights with SmolLM2's tokenizer (49,152 tokens), and a
preset's vocabulary may be larger (Llama 3.1's: 128,256): an id beyond the tokenizer's has no
text, and a piece of a multi-byte character shows none until the character is whole. Either
way the benchmarks' inter-token latency between chunks spans several steps far more often than
with a real model's text; this says how often, for ids drawn from the model's vocabulary and
from the tokenizer's.
"""

from __future__ import annotations

import argparse
import collections
import random

from transformers import AutoTokenizer

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.messages import TextPiece


def quiet_runs(chat: ChatTokenizer, ids: list[int]) -> list[int]:
    """For each chunk of text, how many tokens before it showed none."""
    runs, quiet, prefix, read = [], 0, 0, 0
    for end in range(1, len(ids) + 1):
        update = chat.follow(TextPiece("k", tuple(ids[prefix:end]), prefix, prefix, read))
        prefix, read = update.prefix, update.read
        if update.text:
            runs.append(quiet)
            quiet = 0
        else:
            quiet += 1
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--replies", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-vocab", type=int, default=None, help="default: the tokenizer's")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    chat = ChatTokenizer(tokenizer, len(tokenizer))
    for vocab in dict.fromkeys((args.model_vocab or len(tokenizer), len(tokenizer))):
        rng = random.Random(args.seed)
        runs: list[int] = []
        for _ in range(args.replies):
            runs += quiet_runs(chat, [rng.randrange(vocab) for _ in range(args.tokens)])
        total, most = len(runs), max(collections.Counter(runs))
        print(
            f"ids of a {vocab}-token vocabulary: {args.replies * args.tokens} tokens in {total} "
            f"chunks; after 1+ tokens with no text {sum(r >= 1 for r in runs) / total:.0%}, "
            f"after 3+ {sum(r >= 3 for r in runs) / total:.0%}, at most {most}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
