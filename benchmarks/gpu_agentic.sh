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
# must hold --max-context). Writes OUT_DIR/{nats,http}.json and .txt, and agentic.png.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_agentic.sh OUT_DIR [BENCH OPTIONS ...]}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh

model=${MODEL_ARGS:---model preset:llama2-13b-gqa10 --device cuda --dtype bfloat16 \
--tokenizer .bench/tokenizer --gpu-cache-tokens 196608 --cpu-cache-tokens 262144}
nats_port=${NATS_PORT:-4222}
http_port=${HTTP_PORT:-8000}

# shellcheck disable=SC2086  # $model is a list of options
python3 -m pensieve.ops.cli serve --insecure $model --nats-port "$nats_port" \
    --http-port "$http_port" --data-dir "$out/data" > "$out/serve.txt" 2>&1 &
server=$!
for _ in $(seq 600); do
    grep -q 'OpenAI-compatible API on' "$out/serve.txt" && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
done
if ! grep -q 'OpenAI-compatible API on' "$out/serve.txt"; then
    echo "serve did not start:"
    tail -20 "$out/serve.txt"
    exit 1
fi
work=(agentic --tokenizer .bench/tokenizer --sharegpt .bench/sharegpt.jsonl "$@")
python3 -m pensieve.ops.cli bench "${work[@]}" --nats-url "nats://127.0.0.1:$nats_port" \
    --label nats --json "$out/nats.json" 2>&1 | tee "$out/nats.txt"
python3 -m pensieve.ops.cli bench "${work[@]}" --http "http://127.0.0.1:$http_port" \
    --label http --json "$out/http.json" 2>&1 | tee "$out/http.txt"
kill -INT "$server"
wait "$server"
python3 -m pensieve.ops.cli bench agentic --replot --plot "$out/agentic.png" \
    --compare "$out/nats.json" "$out/http.json"
