#!/usr/bin/env bash
# Several jobs at once on a machine of several GPUs, each on cards of its own: a device minute
# of such a machine then measures as many things as it has jobs. Each job is a command line (run by bash from the
# repository root) that sees its cards alone (CUDA_VISIBLE_DEVICES), writes under $OUT, and
# keeps its servers, ports and scratch files apart from the other's (LOGS, TMPDIR, PORT_BASE).
# The wheels are installed once, before both start (the jobs get WHEELS_DIR=none). CARDS gives
# each job's cards (default "0 1 ...": one GPU each; "0,1 2,3": two each on a machine of four).
#
#   bash benchmarks/gpu_jobs.sh OUT_DIR 'JOB ON GPU 0' 'JOB ON GPU 1' ['JOB ON GPU 2' ...]
#   CARDS="0,1 2,3" bash benchmarks/gpu_jobs.sh OUT_DIR 'TWO-RANK JOB' 'TWO-RANK JOB'
#   bash benchmarks/gpu_jobs.sh /tmp/jobs \
#       'VARIANTS="before direct" bash benchmarks/gpu_actors.sh $OUT 64 128' \
#       'PROBE=0.1 VARIANTS=procs bash benchmarks/gpu_actors.sh $OUT 128'
#
# A comparison belongs inside one job (the same card, one after the other): the jobs share the
# host's cores and memory bandwidth, which each job's own figures say nothing of. Job i writes
# under OUT_DIR/gpu<i> and uses ports from 4300 + 1000 i. Prints each job's last lines when all
# have ended.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_jobs.sh OUT_DIR 'JOB' ['JOB' ...]}
shift
jobs=("$@")
[ "${#jobs[@]}" -ge 1 ] || { echo "usage: gpu_jobs.sh OUT_DIR 'JOB' ['JOB' ...]"; exit 2; }
default_cards=$(seq -s ' ' 0 $((${#jobs[@]} - 1)))
read -ra cards <<< "${CARDS:-$default_cards}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
pids=()
for gpu in "${!jobs[@]}"; do
    dir=$out/gpu$gpu
    mkdir -p "$dir/logs" "$dir/tmp"
    CUDA_VISIBLE_DEVICES=${cards[$gpu]} OUT=$dir LOGS=$dir/logs TMPDIR=$dir/tmp \
        PORT_BASE=$((4300 + 1000 * gpu)) WHEELS_DIR=none \
        bash -c "${jobs[$gpu]}" > "$dir/job.txt" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
for gpu in "${!jobs[@]}"; do
    echo
    echo "== GPU ${cards[$gpu]}: ${jobs[$gpu]}"
    tail -"${TAIL:-16}" "$out/gpu$gpu/job.txt"
done
exit $status
