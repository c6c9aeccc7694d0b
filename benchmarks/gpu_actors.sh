#!/usr/bin/env bash
# The actors on the GPU machine: the same closed-loop ShareGPT work (`benchmarks.bench_serve`,
# every turn a streamed request over NATS) against `pensieve serve` deployed four ways, one after
# the other on the same GPU:
#   before  the build in .bench/before (the engine called in-thread; see benchmarks.md)
#   direct  this build, `--step-channel direct`: the scheduler calls the model in its own thread
#   nats    this build, every actor in one process, step plans to the executor actor over NATS
#   procs   this build, one process per actor, as compose runs them: `pensieve actor executor`,
#           `scheduler --tokenizers 0`, two `tokenizer` replicas, `recompute-planner`, `ingress`
#   nats-tN as nats, with N tokenizer replicas
#   MODE@BUILD  one of the above with the build in .bench/BUILD (e.g. procs@last)
#
#   bash benchmarks/gpu_actors.sh OUT_DIR [CONCURRENCY ...]    (default: 64 128)
#
# carry: .whl and .bench (see gpu_serve.sh). MODEL_ARGS, CONVS, TURNS and TOKENS as there;
# PROBE: seconds between the stats, list and get requests sent beside the load (0: none).
# VARIANTS picks some of the four; REPEAT runs each concurrency that many times against one
# server (rounds interleaved). Logs go to LOGS (default /tmp/gpu_actors). Prints one table row
# per variant and concurrency last: the median output tok/s over the rounds, its ratio to
# `direct` and to `before`, and time to first token.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${1:?usage: gpu_actors.sh OUT_DIR [CONCURRENCY ...]}
shift
concurrencies=("$@")
[ "$#" -eq 0 ] && concurrencies=(64 128)
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=${LOGS:-/tmp/gpu_actors}
mkdir -p "$logs"
repeat=${REPEAT:-1}
model=${MODEL_ARGS:---model preset:llama2-13b-gqa10 --device cuda --dtype bfloat16 \
--tokenizer .bench/tokenizer --gpu-cache-tokens 196608 --cpu-cache-tokens 262144}
work=(--num-conversations "${CONVS:-256}" --max-turns "${TURNS:-3}")
read -ra variants <<< "${VARIANTS:-before direct nats procs}"
installed=.whl

wait_line() {  # FILE PID: the nats URL of the "serving on" line, once the server prints it
    for _ in $(seq 900); do
        url=$(grep -o 'serving on nats://[0-9.:]*' "$1" | head -1 | cut -d' ' -f3)
        [ -n "$url" ] && { echo "$url"; return 0; }
        kill -0 "$2" 2>/dev/null || break
        sleep 0.5
    done
    tail -20 "$1" >&2
    return 1
}

for variant in "${variants[@]}"; do
    dir=$root
    mode=${variant%@*}
    [ "$mode" != "$variant" ] && dir=$root/.bench/${variant#*@}
    [ "$variant" = before ] && dir=$root/.bench/before
    (
        cd "$dir" || exit 1
        # shellcheck source=benchmarks/gpu_env.sh
        WHEELS_DIR=${WHEELS_DIR:-$installed} source benchmarks/gpu_env.sh
        port=$((${PORT_BASE:-4300} + RANDOM % 500))
        pids=()
        log=$logs/server_$variant.txt
        # the load client connects anonymously: a build whose nats-server asks who connects
        # serves it open, on loopback
        open_nats=()
        python3 -m pensieve.ops.cli serve --help | grep -q -- --insecure && open_nats=(--insecure)
        case $mode in
            before) serve=(serve "${open_nats[@]}" --nats-port "$port") ;;
            direct) serve=(serve "${open_nats[@]}" --nats-port "$port" --step-channel direct) ;;
            nats) serve=(serve "${open_nats[@]}" --nats-port "$port" --step-channel nats) ;;
            nats-t*) serve=(serve "${open_nats[@]}" --nats-port "$port" --step-channel nats
                            --tokenizers "${mode#nats-t}") ;;
            procs)
                nats-server -a 127.0.0.1 -p "$port" > "$logs/nats.txt" 2>&1 &
                pids+=($!)
                sleep 1
                # shellcheck disable=SC2086  # $model is a list of options
                python3 -m pensieve.ops.cli actor executor $model --nats-url "nats://127.0.0.1:$port" \
                    --data-dir "$logs/data_$variant" > "$logs/executor.txt" 2>&1 &
                pids+=($!)
                for actor in recompute-planner ingress tokenizer tokenizer; do
                    one=()  # each actor the options it takes; each tokenizer process one replica
                    # shellcheck disable=SC2207  # options_of's words, each an argument
                    [ "$actor" = tokenizer ] && one=(--tokenizers 1 $(options_of --model --tokenizer))
                    python3 -m pensieve.ops.cli actor "$actor" "${one[@]}" \
                        --nats-url "nats://127.0.0.1:$port" --data-dir "$logs/data_$variant" \
                        > "$logs/$actor-${#pids[@]}.txt" 2>&1 &
                    pids+=($!)
                done
                serve=(actor scheduler --tokenizers 0 --nats-url "nats://127.0.0.1:$port") ;;
        esac
        engine=$model
        [ "$mode" = procs ] && engine=$(options_of --model --dtype --tokenizer --seed --block-size)
        # shellcheck disable=SC2086
        python3 -m pensieve.ops.cli "${serve[@]}" $engine \
            --data-dir "$logs/data_$variant" > "$log" 2>&1 &
        server=$!
        url=$(wait_line "$log" "$server") || { echo "$variant did not start"; kill "${pids[@]}" 2>/dev/null; exit 1; }
        for r in $(seq "$repeat"); do
            for c in "${concurrencies[@]}"; do
                name=${variant}_c${c}_r$r
                probe=()  # management requests beside the load, where the client sends them
                grep -q probe-every benchmarks/bench_serve.py && probe=(--probe-every "${PROBE:-0.2}")
                python3 -m benchmarks.bench_serve .bench/sharegpt.jsonl --nats-url "$url" "${probe[@]}" \
                    "${work[@]}" --max-tokens "${TOKENS:-128}" --ignore-eos --concurrency "$c" \
                    --json "$out/$name.json" > "$logs/$name.txt" 2>&1 || tail -5 "$logs/$name.txt"
            done
        done
        kill -INT "$server"
        wait "$server"
        for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null; wait "$pid"; done
    )
    installed=none
done

echo
printf '%-11s %5s %9s %7s %7s %9s %9s %9s %6s %8s\n' variant conc 'tok/s' 'x dir' 'x bef' \
    'ttft p50' 'ttft p90' 'ttft mean' idle 'mgmt p99'
for c in "${concurrencies[@]}"; do
    python3 - "$out" "$c" "$repeat" "${variants[@]}" <<'PY'
import json, statistics, sys
out, c, repeat, *variants = sys.argv[1:]
nan = float("nan")
def median(v, key):
    values = []
    for r in range(1, int(repeat) + 1):
        try:
            values.append(json.load(open(f"{out}/{v}_c{c}_r{r}.json"))[key])
        except (OSError, ValueError, KeyError):
            pass
    return statistics.median(values) if values else nan
def idle(v):
    values = []
    for r in range(1, int(repeat) + 1):
        try:
            device = json.load(open(f"{out}/{v}_c{c}_r{r}.json"))["server"]["device"]
            if device["idle_fraction"] is not None:
                values.append(device["idle_fraction"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return statistics.median(values) if values else nan
def rate(v):
    return median(v, "output_tok_per_s") if v in variants else nan
def management(v):  # the slowest of stats, list and get at their 99th percentile
    values = []
    for r in range(1, int(repeat) + 1):
        try:
            probes = json.load(open(f"{out}/{v}_c{c}_r{r}.json"))["management_s"]
            values.append(max(p["p99"] for p in probes.values() if p["n"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return statistics.median(values) if values else nan
for v in variants:
    print(f"{v:<11} {c:>5} {rate(v):9.1f} {rate(v) / rate('direct'):7.3f} "
          f"{rate(v) / rate('before'):7.3f} {median(v, 'ttft_s_p50'):9.3f} "
          f"{median(v, 'ttft_s_p90'):9.3f} {median(v, 'ttft_s_mean'):9.3f} {idle(v):6.3f} "
          f"{management(v):8.3f}")
PY
done
