#!/usr/bin/env bash
# One run on the GPU machine (no internet): install the carried wheels (.whl, from
# benchmarks/prepare_bench_assets.py), run the GPU tests, then the benchmark with the given
# arguments.
#
#   bash benchmarks/gpu_run.sh --sections policies --policies pensieve --json "$OUT/bench.json"
#
# carry: .whl and .bench. The tests' summary comes first, the benchmark's table last.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider --durations=12 tests 2>&1 | tail -40
[ "$#" -gt 0 ] && python3 -m benchmarks.bench_gpu "$@"
