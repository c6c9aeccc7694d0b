#!/usr/bin/env bash
# Agentic sessions (`pensieve bench agentic`) against `pensieve serve` variants, one server after
# the other: the same sessions over each API, then one plot of every sweep.
#
#   bash benchmarks/gpu_agentic.sh OUT_DIR [BENCH OPTIONS ...]
#       e.g. --sessions 64 --concurrency 8,16,32 --system-tokens 2000 --max-context 16384
#
# carry: .whl and .bench (see gpu_serve.sh): the sessions' text comes from .bench/sharegpt.jsonl
# and they are measured with .bench/tokenizer. MODEL_ARGS as in gpu_serve.sh (the model's context
# must hold --max-context).
# VARIANTS picks the servers: each a policy, then after ':' serve options of its own (',' for a
# space), e.g. VARIANTS="pensieve pensieve:--no-prefix-sharing lru gpu-only stateless"; each is
# named by them, file-safe (pensieve_no-prefix-sharing). Default: POLICIES (policies alone),
# else pensieve. APIS (default: nats http) picks the clients: nats (each new message to the
# conversation), resend (over NATS, the whole chat every turn, no conversation id) and http (the
# OpenAI API, the whole chat every turn; the engine's stats still read over NATS). Each server is
# warmed up before it is measured (WARMUP: that run's options; default 2 sessions, seed 1; fewer
# turns make it shorter at long contexts). Writes OUT_DIR/NAME_API.json and .txt, and agentic.png with
# every run.
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
nats=(--nats-url "nats://127.0.0.1:$nats_port")

variants=(${VARIANTS:-${POLICIES:-pensieve}})
apis=(${APIS:-nats http})
work=(agentic --tokenizer .bench/tokenizer --sharegpt .bench/sharegpt.jsonl "$@")
results=()
for variant in "${variants[@]}"; do
    policy=${variant%%:*}
    extra=()
    [ "$variant" != "$policy" ] && IFS=, read -r -a extra <<< "${variant#*:}"
    name=$(printf %s "$variant" | sed -e 's/:-*/_/; s/,-*/_/g; s/[^A-Za-z0-9._-]/-/g')
    log=$out/serve_$name.txt
    # shellcheck disable=SC2086  # $model is a list of options
    python3 -m pensieve.ops.cli serve --insecure $model --policy "$policy" "${extra[@]}" \
        --nats-port "$nats_port" --http-port "$http_port" --data-dir "$out/data_$name" \
        > "$log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        grep -q 'OpenAI-compatible API on' "$log" && break
        kill -0 "$server" 2>/dev/null || break
        sleep 0.5
    done
    if ! grep -q 'OpenAI-compatible API on' "$log"; then
        echo "serve ($variant) did not start:"
        tail -20 "$log"
        exit 1
    fi
    # warm-up (kernels compiled and tuned, graphs captured) before anything is measured; the
    # chat resent, as every client option allows
    # shellcheck disable=SC2086  # $WARMUP is a list of options
    python3 -m pensieve.ops.cli bench "${work[@]}" "${nats[@]}" --resend \
        ${WARMUP:---sessions 2 --concurrency 2 --seed 1} > "$out/warmup_$name.txt" 2>&1
    for api in "${apis[@]}"; do
        case $api in
            nats) target=("${nats[@]}") ;;
            resend) target=("${nats[@]}" --resend) ;;
            http) target=(--http "http://127.0.0.1:$http_port" "${nats[@]}") ;;
            *) echo "APIS: nats, resend or http, not $api"; exit 1 ;;
        esac
        python3 -m pensieve.ops.cli bench "${work[@]}" "${target[@]}" --label "${name}_$api" \
            --json "$out/${name}_$api.json" > "$out/${name}_$api.txt" 2>&1
        results+=("$out/${name}_$api.json")
    done
    kill -INT "$server"
    wait "$server"
done
for result in "${results[@]}"; do
    echo "== $(basename "$result" .json)"
    tail -n "${TABLE_LINES:-16}" "${result%.json}.txt"
done
python3 -m pensieve.ops.cli bench agentic --replot --plot "$out/agentic.png" \
    --compare "${results[@]}"
