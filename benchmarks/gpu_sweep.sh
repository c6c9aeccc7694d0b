#!/usr/bin/env bash
# `pensieve bench` rate sweeps of cache policies on the GPU machine: for each policy, one
# `pensieve serve --policy P` with the same model and tiers, loaded by `pensieve bench` with
# Poisson arrivals of new ShareGPT conversations at each of RATES (conversations a second) and
# an exponential think time before each next turn; one JSON sweep per policy, labelled with it.
#
#   bash benchmarks/gpu_sweep.sh OUT_DIR POLICY [POLICY ...]     (e.g. pensieve lru stateless)
#
# carry: .whl and .bench (see gpu_serve.sh). MODEL_ARGS, TIERS (the same for every policy),
# RATES (default 1,2,3,4), THINK (mean seconds, default 3), CONVS (default 160), TURNS (4),
# TOKENS (128, end-of-sequence ignored); DURATION and WARMUP (seconds) time each rate's run and
# count only its turns sent after the warm-up (default: every conversation once, all counted).
# A POLICY of the form P+http serves policy P with `--http-port` and drives it through the OpenAI
# API (`pensieve bench --http`), to show what HTTP costs against the NATS path; P+http-actor
# drives it through a `pensieve actor http` process beside the server instead of the HTTP
# ingress in the server's own process. Both HTTP forms go as a tenant (`pensieve tenant add`).
# Prints each sweep's table as it ends.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_sweep.sh OUT_DIR POLICY [POLICY ...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
# shellcheck source=benchmarks/gpu_env.sh
WHEELS_DIR=${WHEELS_DIR:-.whl} source benchmarks/gpu_env.sh
model=${MODEL_ARGS:---model preset:llama2-13b-gqa10 --device cuda --dtype bfloat16 \
--tokenizer .bench/tokenizer}
tiers=${TIERS:---gpu-cache-tokens 32768 --cpu-cache-tokens 65536}
work=(--num-conversations "${CONVS:-160}" --max-turns "${TURNS:-4}" --max-tokens "${TOKENS:-128}"
      --ignore-eos --rates "${RATES:-1,2,3,4}" --think-time "${THINK:-3}")
[ -n "${DURATION:-}" ] && work+=(--duration "$DURATION" --warmup "${WARMUP:-0}")

for label in "$@"; do
    policy=${label%+http*}
    port=$((${PORT_BASE:-4300} + RANDOM % 500))
    http=()
    [ "$label" = "$policy+http" ] && http=(--http-port $((port + 2000)))
    data="${TMPDIR:-/tmp}/gpu_sweep_$label"
    rm -rf "$data"
    # shellcheck disable=SC2086  # $model and $tiers are lists of options
    python3 -m pensieve.ops.cli serve --insecure --policy "$policy" $model $tiers "${http[@]}" \
        --nats-port "$port" --data-dir "$data" > "$out/serve_$label.txt" 2>&1 &
    server=$!
    pids=("$server")
    for _ in $(seq 900); do
        grep -q 'serving on' "$out/serve_$label.txt" && break
        kill -0 "$server" 2>/dev/null || break
        sleep 0.5
    done
    client=(--nats-url "nats://127.0.0.1:$port")
    if [ "$label" != "$policy" ]; then  # over HTTP, as a tenant
        python3 -m pensieve.ops.cli tenant add bench --data-dir "$data" > "$data.tenant.json"
        client=(--http "http://127.0.0.1:$((port + 2000))/v1" --tenant "$data.tenant.json")
    fi
    if [ "$label" = "$policy+http-actor" ]; then
        # shellcheck disable=SC2046  # the actor takes the model's name alone
        python3 -m pensieve.ops.cli actor http $(options_of --model) --http-port $((port + 2000)) \
            --nats-url "nats://127.0.0.1:$port" --data-dir "$data" > "$out/actor_$label.txt" 2>&1 &
        pids+=($!)
        for _ in $(seq 120); do
            grep -q 'HTTP ingress of engine' "$out/actor_$label.txt" && break
            sleep 0.5
        done
    fi
    python3 -m pensieve.ops.cli bench .bench/sharegpt.jsonl "${client[@]}" "${work[@]}" \
        --label "$label" --json "$out/$label.json" > "$out/bench_$label.txt" 2>&1 \
        || tail -5 "$out/bench_$label.txt"
    kill -INT "${pids[@]}"
    wait "${pids[@]}"
    grep -v '^\s*$' "$out/bench_$label.txt" | tail -6
done
