#!/usr/bin/env bash
# Session 16: session 12's simulator ceiling (ops/results/diag_s12/) again on the current build, at
# 16.7 conv/s, the highest rate pensieve and lru both passed on the H200 in session 16. CPU only;
# run from the repository root after ops/prepare_bench_assets.py; writes ceiling.txt beside this.
set -euo pipefail
d=ops/results/diag_s12
common=(--scale 1.05 --cost-profile ops/results/cost_h200_llama2-13b-gqa10.json)
{
for seed in 0 1; do
  echo "== full tiers, 16.7 conv/s, seed $seed: lru; pensieve; pensieve ranked by P(return); lru with an end oracle"
  python3 $d/oracle_sim.py --rates lru=16.7,pensieve=16.7 --seed $seed "${common[@]}" | grep "@"
  python3 $d/predict_sim.py 3.0 x --rates pensieve=16.7 --seed $seed "${common[@]}" | grep "@"
  python3 $d/oracle_sim.py --oracle --rates lru=16.7 --seed $seed "${common[@]}" | grep "@"
done
} 2>&1 | tee ops/results/diag_s16/ceiling.txt
