#!/usr/bin/env bash
# Session 12: what an eviction order could win on the policy workload (simulator, CPU only).
# Run from the repository root after ops/prepare_bench_assets.py; writes out.txt beside this file.
set -euo pipefail
d=ops/results/diag_s12
common=(--scale 1.05 --cost-profile ops/results/cost_h200_llama2-13b-gqa10.json)
{
echo "== the workload's turn counts and the share of conversations that end after turn k"
python3 $d/hazard.py
for seed in 0 1; do
  echo "== full tiers, 16.3 conv/s, seed $seed: lru; pensieve; pensieve ranked by P(return); lru with an end oracle"
  python3 $d/oracle_sim.py --rates lru=16.3,pensieve=16.3 --seed $seed "${common[@]}" | grep "@"
  python3 $d/predict_sim.py 3.0 x --rates pensieve=16.3 --seed $seed "${common[@]}" | grep "@"
  python3 $d/oracle_sim.py --oracle --rates lru=16.3 --seed $seed "${common[@]}" | grep "@"
done
echo "== half the CPU tier, 14 conv/s, seed 0: the same four"
python3 $d/oracle_sim.py --rates lru=14,pensieve=14 --cpu-tokens 131072 --seed 0 "${common[@]}" | grep "@"
python3 $d/predict_sim.py 3.0 x --rates pensieve=14 --cpu-tokens 131072 --seed 0 "${common[@]}" | grep "@"
python3 $d/oracle_sim.py --oracle --rates lru=14 --cpu-tokens 131072 --seed 0 "${common[@]}" | grep "@"
} 2>&1 | tee $d/out.txt
