#!/usr/bin/env bash
# CUDA graphs of steps with prefill pieces (actors/executor/piecewise_graphs.py) on one GPU, in one go:
#   tests  the GPU tests of both kinds of graphs, the cache paths and the fused kernels
#   step   the decode step and the same decodes beside a prompt, eager and from graphs, of
#          MODEL (preset:llama2-13b-gqa10) on one rank (benchmarks/bench_tp.py)
#   serve  the serving benchmark of gpu_actors.sh, the build in .bench/last (`git archive` of the
#          build before) against this one, one after the other on the same GPU
#
#   SECTIONS="tests step serve" bash benchmarks/gpu_graphs.sh OUT_DIR     (~9 minutes)
#
# carry: .whl and .bench (benchmarks/prepare_bench_assets.py, and .bench/last, made here with
# `mkdir -p .bench/last && git archive REV | tar -x -C .bench/last && ln -s .. .bench/last/.bench`
# so that the build before finds the same assets). CONCURRENCY (default "64 128"), REPEAT (2)
# and CONVS (192) size the serving runs. Tables come last.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_graphs.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
read -ra sections <<< "${SECTIONS:-tests step serve}"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for section in "${sections[@]}"; do
    case $section in
        tests)
            timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
                tests/actors/executor/test_piecewise_graphs.py tests/actors/executor/test_cuda_graphs.py \
                tests/actors/executor/test_cache_paths_gpu.py tests/kernels/test_fused.py \
                tests/actors/executor/test_swap_gpu.py 2>&1 | tee "$out/tests.txt" | tail -25 ;;
        step)
            timeout 200 python3 -m benchmarks.bench_tp --ranks 1 \
                --model "${MODEL:-preset:llama2-13b-gqa10}" --json "$out/step.json" \
                > "$out/step.txt" 2>&1 || tail -30 "$out/step.txt" ;;
        serve)
            WHEELS_DIR=none PROBE=0 VARIANTS="direct@last direct" REPEAT=${REPEAT:-2} \
                CONVS=${CONVS:-192} timeout 420 bash benchmarks/gpu_actors.sh "$out/serve" \
                ${CONCURRENCY:-64 128} > "$out/serve.txt" 2>&1 || tail -30 "$out/serve.txt" ;;
    esac
done
echo
grep -h "passed\|failed\|error" "$out/tests.txt" 2>/dev/null | tail -1
[ -f "$out/step.txt" ] && sed -n '/^decode step/,$p' "$out/step.txt"
[ -f "$out/serve.txt" ] && tail -6 "$out/serve.txt"
