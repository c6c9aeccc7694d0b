"""The `pensieve` command line: serve, replay, profile."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pensieve.actors.config import Policy


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["profile"]:  # its own parser takes every option after the word
            from pensieve.ops.cost_profile import main as profile_main

            return int(profile_main(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as error:  # bad input: one clear line, no traceback
        print(f"pensieve: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pensieve", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    replay = commands.add_parser("replay", help="replay conversations through the engine offline")
    replay.add_argument("conversations", help="ShareGPT .json/.jsonl file, or 'sharegpt'")
    replay.add_argument("--out", required=True, help="JSON lines, one per turn ('-' = stdout)")
    _engine_args(replay)
    replay.add_argument("--max-new-tokens", default="256", help="N, or 'dataset'")
    replay.add_argument("--ignore-eos", action="store_true")
    replay.add_argument("--temperature", type=float, default=0.0)
    replay.add_argument("--concurrency", type=int, default=4)
    replay.add_argument("--num-conversations", type=int, default=None)
    replay.add_argument("--max-turns", type=int, default=None, help="turns per conversation")
    replay.add_argument("--emit-token-ids", action="store_true")
    replay.add_argument("--skip-too-long", action="store_true")
    replay.add_argument("--data-dir", type=Path, default=None, help="LMDB store (default: temp)")
    replay.set_defaults(run=_replay)
    serve = commands.add_parser("serve", help="serve the chat API on NATS (all actors here)")
    _engine_args(serve)
    serve.add_argument("--nats-url", default=None, help="default: start nats-server on loopback")
    serve.add_argument("--data-dir", type=Path, default=None, help="LMDB store (default: "
                       "$XDG_DATA_HOME/pensieve or ~/.local/share/pensieve)")  # fmt: skip
    serve.add_argument("--max-waiting", type=int, default=1024, help="then: 'overloaded'")
    serve.add_argument(
        "--trace", default="none", choices=["none", "console", "otlp"],
        help="OpenTelemetry spans (otlp: to $OTEL_EXPORTER_OTLP_ENDPOINT)",
    )  # fmt: skip
    serve.set_defaults(run=_serve)
    commands.add_parser("profile", help="profile chunk recompute cost (pensieve profile --help)")
    return parser


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF folder, .gguf file, 'smollm2', preset:NAME")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--policy", default="pensieve", choices=[p.value for p in Policy])
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--gpu-cache-tokens", type=int, default=None)
    p.add_argument("--cpu-cache-tokens", type=int, default=None)
    p.add_argument("--gpu-cache-gb", type=float, default=None)
    p.add_argument("--cpu-cache-gb", type=float, default=None)
    p.add_argument("--admission-reserve", type=float, default=0.10)
    p.add_argument("--swap-out-threshold", type=float, default=0.25)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--admit-batch",
        type=int,
        default=8,
        help="a decode-only step admits once this many running slots are free (1: at once)",
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="plan each step only after the one before is applied (default: while it runs)",
    )
    p.add_argument("--profile", default=None, help="cost table from `pensieve profile`")
    p.add_argument("--seed", type=int, default=0)


def engine_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pensieve.ops.factory import EngineOptions

    return EngineOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        policy=Policy(args.policy),
        block_size=args.block_size,
        gpu_cache_tokens=args.gpu_cache_tokens,
        cpu_cache_tokens=args.cpu_cache_tokens,
        gpu_cache_gb=args.gpu_cache_gb,
        cpu_cache_gb=args.cpu_cache_gb,
        admission_reserve=args.admission_reserve,
        swap_out_threshold=args.swap_out_threshold,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        admit_batch=args.admit_batch,
        overlap=args.overlap,
        profile=args.profile,
        seed=args.seed,
    )


def _serve(args: argparse.Namespace) -> int:
    from pensieve.ops.factory import build, frozen_heap
    from pensieve.ops.serve import default_data_dir, run
    from pensieve.ops.telemetry import setup_tracing

    if args.max_waiting < 1:
        raise ValueError("--max-waiting must be >= 1")
    provider = setup_tracing(args.trace)
    built = build(engine_options(args))
    try:
        with frozen_heap():
            return run(built, args.data_dir or default_data_dir(), args.nats_url, args.max_waiting)
    finally:
        if provider is not None:
            provider.shutdown()  # flush the spans still batched


def _replay(args: argparse.Namespace) -> int:
    from pensieve.ops.factory import build, frozen_heap
    from pensieve.ops.replay import ReplayOptions, replay
    from pensieve.ops.sharegpt import load_conversations

    if args.max_new_tokens == "dataset":
        max_new: int | None = None
    elif args.max_new_tokens.isdigit() and int(args.max_new_tokens) > 0:
        max_new = int(args.max_new_tokens)
    else:
        raise ValueError(
            f"--max-new-tokens must be a positive number or 'dataset', got {args.max_new_tokens!r}"
        )
    if args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    conversations = load_conversations(args.conversations, args.num_conversations)
    built = build(engine_options(args))
    options = ReplayOptions(
        max_new_tokens=max_new,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        concurrency=args.concurrency,
        seed=args.seed,
        emit_token_ids=args.emit_token_ids,
        skip_too_long=args.skip_too_long,
        max_turns=args.max_turns,
    )
    with frozen_heap():
        if args.out == "-":
            summary = replay(built, conversations, options, sys.stdout.buffer, args.data_dir)
        else:
            with open(args.out, "wb") as out:
                summary = replay(built, conversations, options, out, args.data_dir)
    _print_summary(summary, built)
    return 0


def _print_summary(summary, built) -> None:  # type: ignore[no-untyped-def]
    prompt = max(summary.prompt_tokens, 1)
    cached = summary.cached
    hit = (cached["gpu"] + cached["cpu"]) / prompt
    stats = built.engine.runner.swap.collect_stats()
    print(
        f"turns {summary.turns}  output tokens {summary.output_tokens}  "
        f"{summary.output_tokens / max(summary.seconds, 1e-9):.1f} tok/s  "
        f"in {summary.seconds:.1f} s\n"
        f"prompt tokens {summary.prompt_tokens}: gpu {cached['gpu']}  cpu {cached['cpu']}  "
        f"recomputed {cached['recomputed']}  new {summary.new_prompt_tokens}  "
        f"(cache hit rate {hit:.1%})\n"
        f"swaps: in {stats.bytes_in / 1e6:.1f} MB in {stats.seconds_in:.3f} s, "
        f"out {stats.bytes_out / 1e6:.1f} MB in {stats.seconds_out:.3f} s; "
        f"suspensions {built.engine.scheduler.num_suspensions}"
        + (
            f"; skipped conversations {summary.skipped_conversations}"
            if summary.skipped_conversations
            else ""
        ),
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
