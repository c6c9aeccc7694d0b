#!/usr/bin/env bash
# What `"final": true` recovers: one `pensieve serve` on the GPU, the closed-loop ShareGPT load of
# `benchmarks.bench_serve` in rounds that alternate between clients that end each conversation
# with a final turn (its KV freed at once) and clients that do not (its KV stays until evicted).
# Tiers small enough that eviction matters.
#
#   bash benchmarks/gpu_final.sh OUT_DIR [CONCURRENCY]      (default 128)
#
# carry: .whl and .bench (see gpu_serve.sh). ROUNDS pairs (default 2), CONVS, TURNS, TOKENS,
# TIERS. Prints one row per kind last: median output tok/s, and the prompt tokens recomputed,
# swapped in from the CPU and kept on the GPU, summed over its rounds.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_final.sh OUT_DIR [CONCURRENCY]}
c=${2:-128}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# shellcheck source=benchmarks/gpu_env.sh
WHEELS_DIR=${WHEELS_DIR:-.whl} source benchmarks/gpu_env.sh
model=${MODEL_ARGS:---model preset:llama2-13b-gqa10 --device cuda --dtype bfloat16 \
--tokenizer .bench/tokenizer}
tiers=${TIERS:---gpu-cache-tokens 49152 --cpu-cache-tokens 65536}
port=$((4300 + RANDOM % 500))
# shellcheck disable=SC2086
python3 -m pensieve.ops.cli serve --insecure $model $tiers --nats-port "$port" \
    --data-dir /tmp/gpu_final_data > "$out/serve.txt" 2>&1 &
server=$!
for _ in $(seq 900); do grep -q 'serving on' "$out/serve.txt" && break; sleep 0.5; done
for r in $(seq "${ROUNDS:-2}"); do
    for kind in open final; do
        flag=()
        [ "$kind" = final ] && flag=(--final)
        python3 -m benchmarks.bench_serve .bench/sharegpt.jsonl --nats-url "nats://127.0.0.1:$port" \
            --num-conversations "${CONVS:-256}" --max-turns "${TURNS:-4}" \
            --max-tokens "${TOKENS:-128}" --ignore-eos --concurrency "$c" --probe-every 0 \
            "${flag[@]}" --json "$out/${kind}_r$r.json" > "$out/${kind}_r$r.txt" 2>&1 \
            || tail -5 "$out/${kind}_r$r.txt"
    done
done
kill -INT "$server"
wait "$server"
python3 - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
print(f"{'clients':<8} {'tok/s':>9} {'recomputed':>11} {'from cpu':>9} {'on gpu':>9} {'new':>9}")
for kind in ("open", "final"):
    runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{kind}_r*.json"))]
    if not runs:
        continue
    rate = statistics.median(r["output_tok_per_s"] for r in runs)
    cached = {k: sum(r["prompt_sources"][k] for r in runs) for k in ("recomputed", "cpu", "gpu")}
    new = sum(r["prompt_sources"]["new"] for r in runs)
    print(f"{kind:<8} {rate:9.1f} {cached['recomputed']:11d} {cached['cpu']:9d} "
          f"{cached['gpu']:9d} {new:9d}")
PY
