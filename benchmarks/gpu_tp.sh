#!/usr/bin/env bash
# Tensor parallelism on a machine of two GPUs (nvidia-h100-x2 or nvidia-h200-x2), in one go:
#   tests   the parity tests over NCCL: tiny Llama-family and OPT models in fp32, logits within
#           1e-5 and the same greedy tokens on 2 ranks as on 1 (Triton kernels, CUDA graphs of
#           decodes); two executor rank processes against a scheduler over NATS on every cache
#           path, against one stateless rank
#   decode  the decode step of preset:llama2-13b-gqa10 (bf16) at batch 64 and ~4k context on 1
#           rank and on 2, side by side (benchmarks/bench_tp.py; DECODE_MODEL and DECODE_RANKS,
#           e.g. preset:llama2-70b and "2 4" on four GPUs), the split runs once for each of
#           ALL_REDUCE_MODES (default "nccl peer": NCCL's all-reduce, symmetric memory's)
#   replay  the 48-conversation closed loop on 1 rank and on 2, for each of ALL_REDUCE_MODES
#           and of MIXED_GRAPHS ("on", "off" or both: steps with prefill pieces from graphs cut
#           at attention, or eager) (benchmarks/bench_tp_replay.py; needs .bench from
#           prepare_bench_assets.py); PROFILE=FIRST,COUNT profiles every rank over those steps
#           of each loop (kernels by kind, host launch time, all-reduce transfer and wait)
#   paper   the paper's experiment: preset:llama2-70b (bf16) on RANKS ranks (2), bench_gpu's
#           policies section (multi-turn ShareGPT, Poisson arrivals, think time, the same
#           tiers for every policy) for POLICIES (pensieve,stateless), each at RATES
#           (conversations/s, e.g. pensieve=3/4,stateless=2/3) or swept from its start rate
#           (STARTS, default pensieve=4,lru=4,gpu-only=3,stateless=2.5: the 70B on two H200s);
#           MODEL, GPU_TOKENS, CPU_TOKENS, DURATION, WARMUP, MAX_POINTS (runs per policy, 2),
#           RATE_FACTOR (a sweep's step, 1.2), WARMUP_RUN (the discarded first run, 15 s) and
#           TIME_LIMIT (540 s) change the setting (two H200s hold the 70B with room for KV; two
#           H100s leave ~9 GB each: use a 34B-class shape there); ALL_REDUCE (nccl, peer) picks
#           how the ranks sum
#
#   bash benchmarks/gpu_tp.sh [OUT_DIR]                      (tests and decode: ~6 minutes)
#   SECTIONS=replay bash benchmarks/gpu_tp.sh [OUT_DIR]       (~5 minutes)
#   SECTIONS=paper bash benchmarks/gpu_tp.sh [OUT_DIR]        (~9 minutes)
#
# carry: .whl and .bench (benchmarks/prepare_bench_assets.py; without .whl, what the image has
# is used). Each section is bounded in time; the tables come last.
# NVLink multicast stays off, as the GPU machines require.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_tp}}
mkdir -p "$out"
read -ra sections <<< "${SECTIONS:-tests decode}"
[ -d .whl ] || export WHEELS_DIR=none
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PENSIEVE_ALL_REDUCE=${ALL_REDUCE:-nccl}
read -ra modes <<< "${ALL_REDUCE_MODES:-nccl peer}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      "GPUs", torch.cuda.device_count())'
for section in "${sections[@]}"; do
    case $section in
        tests)
            timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
                tests/models/test_tensor_parallel.py tests/actors/executor/test_executor_ranks.py \
                2>&1 | tee "$out/tests.txt" | tail -30 ;;
        decode)
            read -ra decode_ranks <<< "${DECODE_RANKS:-1 2}"
            timeout "${DECODE_TIMEOUT:-200}" python3 -m benchmarks.bench_tp \
                --model "${DECODE_MODEL:-preset:llama2-13b-gqa10}" --ranks "${decode_ranks[@]}" \
                --all-reduce "${modes[@]}" --json "$out/bench_tp.json" \
                > "$out/decode.txt" 2>&1 || tail -30 "$out/decode.txt" ;;
        replay)
            read -ra mixed <<< "${MIXED_GRAPHS:-on}"
            profile=()
            [ -n "${PROFILE:-}" ] && profile=(--profile "$PROFILE")
            timeout 330 python3 -m benchmarks.bench_tp_replay --all-reduce "${modes[@]}" \
                --mixed-graphs "${mixed[@]}" "${profile[@]}" --json "$out/bench_tp_replay.json" \
                > "$out/replay.txt" 2>&1 || tail -30 "$out/replay.txt" ;;
        paper)
            rates=()
            [ -n "${RATES:-}" ] && rates=(--rates "$RATES")
            limit=${TIME_LIMIT:-540}
            timeout $((limit + 30)) python3 -m benchmarks.bench_gpu --sections policies \
                --model "${MODEL:-preset:llama2-70b}" --tensor-parallel "${RANKS:-2}" \
                --cost analytic --policies "${POLICIES:-pensieve,stateless}" "${rates[@]}" \
                --start-rates "${STARTS:-pensieve=4,lru=4,gpu-only=3,stateless=2.5}" \
                --gpu-tokens "${GPU_TOKENS:-65536}" --cpu-tokens "${CPU_TOKENS:-262144}" \
                --duration "${DURATION:-50}" --warmup "${WARMUP:-25}" \
                --warmup-run "${WARMUP_RUN:-15}" \
                --max-points "${MAX_POINTS:-2}" --rate-factor "${RATE_FACTOR:-1.2}" \
                --time-limit "$limit" \
                --json "$out/bench_paper.json" \
                > "$out/paper.txt" 2>&1 || tail -30 "$out/paper.txt" ;;
    esac
done
echo
grep -h "passed\|failed\|error" "$out/tests.txt" 2>/dev/null | tail -1
for f in decode replay; do [ -f "$out/$f.txt" ] && tail -5 "$out/$f.txt"; done
[ -f "$out/paper.txt" ] && sed -n '/=== Pensieve benchmarks/,$p' "$out/paper.txt"
