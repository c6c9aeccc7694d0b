"""The sampler alone: time per call of `sample_async` for a batch of sampled rows, side by side
with the sampler of another revision of this repository, on one device.

    python -m benchmarks.bench_sampler [--device cuda] [--against REV] [--repeat N]

Each case is rows x vocabulary with one setting for every row (temperature, top-p, top-k); the
time is of the call and of reading the tokens back (`.tolist()`), as a step reads them. `--against`
loads `actors/executor/sampler.py` as it was at REV (`git show`), or the file REV names (on a
machine without the repository's history), beside the current one.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from pensieve.actors.executor import sampler as current
from pensieve.actors.wire.step import SamplingParams

CASES = [  # rows, vocabulary, temperature, top_p, top_k
    (64, 49152, 1.0, 1.0, None),
    (64, 49152, 0.7, 0.9, None),
    (64, 128256, 0.7, 0.95, None),
    (8, 128256, 0.7, 0.95, 50),
    (256, 128256, 0.8, 1.0, 20),
]


def load_revision(rev: str) -> ModuleType:
    if Path(rev).is_file():
        return load_source(Path(rev).read_text())
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:actors/executor/sampler.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return load_source(source)


def load_source(source: str) -> ModuleType:
    path = Path(tempfile.mkdtemp()) / "sampler_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_call(module: ModuleType, logits: torch.Tensor, params: list, repeat: int) -> float:
    indices = list(range(len(params)))
    module.sample_async(logits, params, indices).tolist()  # warm
    if logits.is_cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeat):
        module.sample_async(logits, params, indices).tolist()
    return (time.perf_counter() - began) / repeat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--against", metavar="REV", help="a revision whose sampler runs beside")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    other = load_revision(args.against) if args.against else None
    print(f"| rows x vocab | temperature, top_p, top_k | this build (ms) | {args.against or ''} |")
    print("|---|---|---|---|")
    for rows, vocab, temperature, top_p, top_k in CASES:
        logits = torch.randn(rows, vocab, device=device) * 4
        params = [SamplingParams(4, temperature, top_p, top_k, seed=i) for i in range(rows)]
        ours = time_call(current, logits, params, args.repeat)
        theirs = (
            "" if other is None else f"{1e3 * time_call(other, logits, params, args.repeat):.2f}"
        )
        print(
            f"| {rows} x {vocab} | {temperature}, {top_p}, {top_k} | {1e3 * ours:.2f} | {theirs} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
