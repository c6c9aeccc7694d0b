#!/usr/bin/env bash
# The serving layer on the GPU machine: the same closed-loop ShareGPT work through `pensieve
# replay` (the engine driven directly) and through `pensieve serve` + `benchmarks.bench_serve`
# (every turn a streamed request over a real nats-server), at each concurrency given, on one model.
#
#   bash benchmarks/gpu_serve.sh OUT_DIR [CONCURRENCY ...]    (default concurrencies: 16 64 128)
#
# carry: .whl and .bench (wheels, the tokenizer and sharegpt.jsonl from
# benchmarks/prepare_bench_assets.py). MODEL_ARGS overrides the model and tier options; CONVS,
# TURNS and TOKENS size the work. Prints one table row per run last.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_serve.sh OUT_DIR [CONCURRENCY ...]}
shift
concurrencies=("$@")
[ "$#" -eq 0 ] && concurrencies=(16 64 128)
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh

model=${MODEL_ARGS:---model preset:llama2-13b-gqa10 --device cuda --dtype bfloat16 \
--tokenizer .bench/tokenizer --gpu-cache-tokens 196608 --cpu-cache-tokens 262144}
convs=${CONVS:-256}
turns=${TURNS:-3}
tokens=${TOKENS:-128}
data=.bench/sharegpt.jsonl
work=(--num-conversations "$convs" --max-turns "$turns")

for c in "${concurrencies[@]}"; do
    # shellcheck disable=SC2086  # $model is a list of options
    python3 -m pensieve.ops.cli replay "$data" $model "${work[@]}" --max-new-tokens "$tokens" \
        --ignore-eos --skip-too-long --concurrency "$c" --out /dev/null \
        > "$out/replay_c$c.txt" 2>&1
    tail -3 "$out/replay_c$c.txt"
done

# shellcheck disable=SC2086
python3 -m pensieve.ops.cli serve --insecure $model > "$out/serve.txt" 2>&1 &  # loopback, no accounts
server=$!
url=""
for _ in $(seq 600); do
    url=$(grep -o 'serving on nats://[0-9.:]*' "$out/serve.txt" | head -1 | cut -d' ' -f3)
    [ -n "$url" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
done
if [ -z "$url" ]; then
    echo "serve did not start:"
    tail -20 "$out/serve.txt"
    exit 1
fi
for c in "${concurrencies[@]}"; do
    python3 -m benchmarks.bench_serve "$data" --nats-url "$url" "${work[@]}" \
        --max-tokens "$tokens" --ignore-eos --concurrency "$c" --json "$out/serve_c$c.json" \
        > "$out/serve_c$c.txt" 2>&1 || tail -5 "$out/serve_c$c.txt"
done
kill -INT "$server"
wait "$server"

echo
printf '%-6s %7s %6s %7s %6s %7s\n' conc replay turns serve turns ratio  # tok/s, serve / replay
for c in "${concurrencies[@]}"; do
    python3 - "$out/replay_c$c.txt" "$out/serve_c$c.json" "$c" <<'PY'
import json, re, sys
replay, serve, c = sys.argv[1:]
m = re.findall(r"turns (\d+)  output tokens \d+  ([0-9.]+) tok/s", open(replay).read())
r_turns, r_rate = m[-1] if m else ("?", "nan")
try:
    s = json.load(open(serve))
    s_turns, s_rate = s["turns"], s["output_tok_per_s"]
except (OSError, ValueError, KeyError):
    s, s_turns, s_rate = {}, "?", float("nan")
ratio = s_rate / float(r_rate) if float(r_rate) else float("nan")
print(f"{c:<6} {float(r_rate):7.1f} {r_turns:>6} {s_rate:7.1f} {s_turns:>6} {ratio:7.3f}")
server = s.get("server")
if server:  # the engine's own totals over the load (pensieve.v1.stats)
    src = server["tokens"]["prompt_sources"]
    swaps = " ".join(f"{d} {w['bytes'] / 1e9:.1f} GB at {w['gb_per_s'] or 0:.1f} GB/s"
                     for d, w in server["swaps"].items())
    print(f"       server: gpu/cpu/recomp/new {src['gpu']}/{src['cpu']}/{src['recomputed']}/"
          f"{src['new']}; swaps {swaps}; suspensions {server['suspensions']}")
PY
done
