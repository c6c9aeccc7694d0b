#!/usr/bin/env bash
# Tensor parallelism on a machine of two GPUs (nvidia-h100-x2 or nvidia-h200-x2), in one go:
#   1. the parity tests over NCCL: tiny Llama-family and OPT models in fp32, logits within 1e-5
#      and the same greedy tokens on 2 ranks as on 1 (Triton kernels, CUDA graphs of decodes),
#      and the executor ranks' tests
#   2. the decode step of preset:llama2-13b-gqa10 (bf16) at batch 64 and ~4k context on 1 rank
#      and on 2, side by side (benchmarks/bench_tp.py); the table is printed last
#
#   bash benchmarks/gpu_tp.sh [OUT_DIR]
#
# carry: .whl (benchmarks/prepare_bench_assets.py; without it, what the image has is used).
# Runs in about 5 minutes. NVLink multicast stays off, as the GPU machines require.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_tp}}
mkdir -p "$out"
[ -d .whl ] || export WHEELS_DIR=none
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      "GPUs", torch.cuda.device_count())'
tests=(tests/models/test_tensor_parallel.py)
[ -f tests/actors/test_executor_ranks.py ] && tests+=(tests/actors/test_executor_ranks.py)
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs "${tests[@]}" 2>&1 | tee "$out/tests.txt" | tail -25
timeout 240 python3 -m benchmarks.bench_tp --json "$out/bench_tp.json" 2>&1 | tee "$out/bench_tp.txt" | tail -15
