#!/usr/bin/env bash
# One call on the GPU machine (no internet): install the carried wheels (.whl, from
# ops/prepare_bench_assets.py), run the GPU tests, then the benchmark with the given arguments.
#
#   bash ops/gpu_run.sh --sections policies --policies pensieve --json "$OUT/bench.json"
#
# carry: .whl and .bench. The tests' summary comes first, the benchmark's table last.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=ops/gpu_env.sh
source ops/gpu_env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -25
[ "$#" -gt 0 ] && python3 -m pensieve.ops.bench_gpu "$@"
