#!/usr/bin/env bash
# Many engines on one NATS, one engine per GPU (nvidia-h200-x2), with benchmarks/bench_placement.py:
#   capacity   one engine against two, each engine meeting the same closed-loop load (ShareGPT
#              conversations), swept over LEVELS clients per engine to past the knee: turns/s,
#              tokens/s, goodput
#   placement  two engines, new conversations placed at random against by load, LEVEL clients
#              per engine
#   resent     two engines, clients that resend their whole history every turn (no conversation
#              id; groups of conversations share a long system prompt): placement at random
#              against by cached prefix (cache hit share, TTFT)
#   failover   two engines with the turn log on JetStream, CONCURRENCY clients each; engine 0
#              killed (SIGKILL) KILL_AFTER s into the load: time from the kill to each of its
#              conversations' next turn answered, those turns' TTFT, acknowledged turns lost
#
#   SECTIONS=capacity bash benchmarks/gpu_engines.sh OUT_DIR
#   SECTIONS="failover resent placement" bash benchmarks/gpu_engines.sh OUT_DIR
#
# carry: .whl and .bench (benchmarks/prepare_bench_assets.py). MODEL (default
# preset:llama2-13b-gqa10, bf16) and SERVE (each engine's `pensieve serve` options) change the
# setting; the load: CONVERSATIONS (ShareGPT JSON Lines, gzipped or not, of 3,000
# conversations), LEVELS (32,96,192), LEVEL (96), PER_CLIENT (4 conversations a client and
# level), CONCURRENCY (64), NUM_CONVERSATIONS (resent: 128), TURNS (4), TOKENS (128), GOODPUT
# (ttft:2000 tpot:100), KILL_AFTER (5 s), SILENCE (2 s). Writes OUT_DIR/SECTION.json and .txt;
# the lines of every section last. Figures: docs/benchmarks/many-engines.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_engines.sh OUT_DIR}
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

model=${MODEL:-preset:llama2-13b-gqa10}
read -ra serve <<< "${SERVE:---device cuda --dtype bfloat16 --tokenizer .bench/tokenizer \
--gpu-cache-tokens 131072 --cpu-cache-tokens 262144}"
serve_options=()
for option in "${serve[@]}"; do serve_options+=("--serve-option=$option"); done
conversations=${CONVERSATIONS:-.bench/sharegpt-engines.jsonl.gz}
if [[ $conversations == *.gz ]]; then
    gunzip -c "$conversations" > /tmp/sharegpt-engines.jsonl || exit 1
    conversations=/tmp/sharegpt-engines.jsonl
fi
read -ra goodput <<< "${GOODPUT:-ttft:2000 tpot:100}"
common=(--model "$model" --gpus 0,1 --max-turns "${TURNS:-4}" --max-tokens "${TOKENS:-128}"
    --goodput "${goodput[@]}" "${serve_options[@]}")

section() {  # NAME BENCH OPTIONS...
    local name=$1
    shift
    echo "== $name" | tee "$out/$name.txt"
    python3 -m benchmarks.bench_placement "${common[@]}" "$@" --json "$out/$name.json" \
        2>&1 | tee -a "$out/$name.txt"
}

for name in ${SECTIONS:-capacity placement resent failover}; do
    case $name in
        capacity)
            section capacity --runs 1:load,2:load --per-engine \
                --concurrency "${LEVELS:-32,96,192}" --conversations "$conversations" \
                --conversations-per-client "${PER_CLIENT:-4}" ;;
        placement)
            section placement --runs 2:random,2:load --per-engine --concurrency "${LEVEL:-96}" \
                --conversations "$conversations" --conversations-per-client "${PER_CLIENT:-4}" ;;
        resent)
            section resent --runs 2:random,2:prefix --workload resent --conversations synthetic \
                --concurrency 16 --num-conversations "${NUM_CONVERSATIONS:-128}" ;;
        failover)
            section failover --runs 2:load --per-engine --concurrency "${CONCURRENCY:-64}" \
                --conversations "$conversations" --conversations-per-client "${PER_CLIENT:-4}" \
                --failover "${KILL_AFTER:-5}" --silence "${SILENCE:-2}" ;;
        *) echo "unknown section $name" ; exit 2 ;;
    esac
done
echo
for name in ${SECTIONS:-capacity placement resent failover}; do
    grep -v '^==' "$out/$name.txt" | grep -E '^ *(1|2) x |failover:' | sed "s/^/$name  /"
done
