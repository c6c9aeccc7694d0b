#!/usr/bin/env bash
# The OpenAI HTTP API against the NATS API on one server: the same closed-loop ShareGPT work
# through `pensieve bench` over NATS, and `pensieve bench --http` through the HTTP ingress in the
# server's process (`pensieve serve --http-port`) and in one of its own (`pensieve actor http`),
# each turn streamed, alternated ROUNDS times at each concurrency, so drift hits all alike. Both
# HTTP paths go as a tenant (`pensieve tenant add`), as they do in production.
#
#   bash benchmarks/gpu_http.sh OUT_DIR [CONCURRENCY ...]    (default concurrencies: 16 64)
#
# carry: .whl and .bench (see gpu_serve.sh). MODEL_ARGS, CONVS, TURNS and TOKENS as there;
# ROUNDS (default 2). Prints one row per concurrency last: the median output tokens/s of each
# path and the HTTP paths' ratios to NATS.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_http.sh OUT_DIR [CONCURRENCY ...]}
shift
concurrencies=("$@")
[ "$#" -eq 0 ] && concurrencies=(16 64)
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh

model=${MODEL_ARGS:---model preset:llama2-13b-gqa10 --device cuda --dtype bfloat16 \
--tokenizer .bench/tokenizer --gpu-cache-tokens 196608 --cpu-cache-tokens 262144}
rounds=${ROUNDS:-2}
data=${DATA:-.bench/sharegpt.jsonl}
work=(--num-conversations "${CONVS:-256}" --max-turns "${TURNS:-3}" --max-tokens "${TOKENS:-128}"
      --ignore-eos)
nats_port=${NATS_PORT:-4222}
http_port=${HTTP_PORT:-8000}
actor_port=$((http_port + 1))

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
python3 -m pensieve.ops.cli tenant add bench --data-dir "$out/data" > "$out/tenant.json" 2>/dev/null
# shellcheck disable=SC2046  # the actor takes the model's name alone
python3 -m pensieve.ops.cli actor http $(options_of --model) --http-port "$actor_port" --data-dir "$out/data" \
    --nats-url "nats://127.0.0.1:$nats_port" > "$out/actor.txt" 2>&1 &
actor=$!
for _ in $(seq 120); do
    grep -q 'HTTP ingress of engine' "$out/actor.txt" && break
    sleep 0.5
done
bench() {  # NAME, then bench's connection options
    local name=$1
    shift
    python3 -m pensieve.ops.cli bench "$data" "${work[@]}" --concurrency "$c" "$@" \
        --label "$name" --json "$out/${name}_c${c}_r$r.json" > "$out/${name}_c${c}_r$r.txt" 2>&1
}
for c in "${concurrencies[@]}"; do
    for r in $(seq "$rounds"); do
        bench nats --nats-url "nats://127.0.0.1:$nats_port"
        bench http --http "http://127.0.0.1:$http_port" --tenant "$out/tenant.json"
        bench actor --http "http://127.0.0.1:$actor_port" --tenant "$out/tenant.json"
    done
done
kill -INT "$actor" "$server"
wait "$actor" "$server"

echo
python3 - "$out" "${concurrencies[@]}" <<'PY'
import glob, json, statistics, sys
out, concurrencies = sys.argv[1], sys.argv[2:]
paths = ("nats", "http", "actor")  # actor: the HTTP ingress in a process of its own
print(f"{'conc':<6}" + "".join(f" {p + ' tok/s':>11}" for p in paths)
      + f" {'http/nats':>9} {'actor/nats':>10}  errors")
for c in concurrencies:
    rates, errors = {}, {}
    for path in paths:
        runs = []
        for name in sorted(glob.glob(f"{out}/{path}_c{c}_r*.json")):
            runs += json.load(open(name))["runs"]
        rates[path] = statistics.median(r["output_tok_per_s"] for r in runs) if runs else float("nan")
        errors[path] = sum(sum(r["errors"].values()) for r in runs)
    ratio = {p: rates[p] / rates["nats"] if rates["nats"] else float("nan") for p in paths}
    print(f"{c:<6}" + "".join(f" {rates[p]:11.1f}" for p in paths)
          + f" {ratio['http']:9.3f} {ratio['actor']:10.3f}  {errors}")
PY
