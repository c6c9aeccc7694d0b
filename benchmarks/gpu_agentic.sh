#!/usr/bin/env bash
# Agentic sessions (`pensieve bench agentic`) against one `pensieve serve`: the same sessions over
# NATS and over the OpenAI API (a client that resends its history every turn), one after the
# other, then one plot of both sweeps.
#
#   bash benchmarks/gpu_agentic.sh OUT_DIR [BENCH OPTIONS ...]
#       e.g. --sessions 64 --concurrency 8,16,32 --system-tokens 2000 --max-context 16384
#
# carry: .whl and .bench (see gpu_serve.sh): the sessions' text comes from .bench/sharegpt.jsonl
# and they are measured with .bench/tokenizer. MODEL_ARGS as in gpu_serve.sh (the model's context
# must hold --max-context). POLICIES (default: pensieve) and APIS (default: nats http) pick the
# servers and clients, one server per policy; writes OUT_DIR/POLICY_API.json and .txt, and
# agentic.png with every run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_agentic.sh OUT_DIR [BENCH OPTIONS ...]}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh

model=${MODEL_ARGS:---model preset:llama2-13b-gqa10 --device cuda --dtype bfloat16 \
--tokenizer .bench/tokenizer --gpu-cache-tokens 196608 --cpu-cache-tokens 262144}
nats_port=${NATS_PORT:-${PORT_BASE:-4222}}  # gpu_jobs.sh gives each job a PORT_BASE
http_port=${HTTP_PORT:-$((${PORT_BASE:-7999} + 1))}

policies=(${POLICIES:-pensieve})
apis=(${APIS:-nats http})
work=(agentic --tokenizer .bench/tokenizer --sharegpt .bench/sharegpt.jsonl "$@")
results=()
for policy in "${policies[@]}"; do
    log=$out/serve_$policy.txt
    # shellcheck disable=SC2086  # $model is a list of options
    python3 -m pensieve.ops.cli serve --insecure $model --policy "$policy" \
        --nats-port "$nats_port" --http-port "$http_port" --data-dir "$out/data_$policy" \
        > "$log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        grep -q 'OpenAI-compatible API on' "$log" && break
        kill -0 "$server" 2>/dev/null || break
        sleep 0.5
    done
    if ! grep -q 'OpenAI-compatible API on' "$log"; then
        echo "serve ($policy) did not start:"
        tail -20 "$log"
        exit 1
    fi
    # warm-up (kernels compiled and tuned, graphs captured) before anything is measured
    python3 -m pensieve.ops.cli bench "${work[@]}" --nats-url "nats://127.0.0.1:$nats_port" \
        --sessions 2 --concurrency 2 --seed 1 > "$out/warmup_$policy.txt" 2>&1
    for api in "${apis[@]}"; do
        name=${policy}_$api
        target=(--nats-url "nats://127.0.0.1:$nats_port")
        [ "$api" = http ] && target=(--http "http://127.0.0.1:$http_port")
        python3 -m pensieve.ops.cli bench "${work[@]}" "${target[@]}" --label "$name" \
            --json "$out/$name.json" > "$out/$name.txt" 2>&1
        results+=("$out/$name.json")
    done
    kill -INT "$server"
    wait "$server"
done
for result in "${results[@]}"; do
    echo "== $(basename "$result" .json)"
    tail -n "${TABLE_LINES:-14}" "${result%.json}.txt"
done
python3 -m pensieve.ops.cli bench agentic --replot --plot "$out/agentic.png" \
    --compare "${results[@]}"
