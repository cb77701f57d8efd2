#!/usr/bin/env bash
# llm-d's shared-prefix workload through its own harness (inference-perf),
# Hearth beside smg's cache_aware (defaults and tuned), and Envoy
# least_request, on two real vLLM replicas: the low-rate cell (4 groups
# of 3 users, 2 then 8 requests/s) and the saturating one (8 groups, 16
# then 32 requests/s).
# Engines: target/release/hearth-bench vllm --replicas 2 --max-num-seqs 4 --shared-name-first
# Usage: ENGINES=A,B bench/results/peers/compare-vllm-inference-perf-smg/run.sh [SEEDS...]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/peers/compare-vllm-inference-perf-smg
seeds=("$@"); [ ${#seeds[@]} -eq 0 ] && seeds=(1 2 3)
for s in "${seeds[@]}"; do
  for cell in "low 12 2,8" "saturating 24 16,32"; do
    read -r name users rates <<< "$cell"
    target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
      --conversations "$users" --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
      --max-tokens 32 --rates "$rates" --stage-seconds 30 --reset-caches --seed "$s" \
      --policies hearth,least_request,smg_cache_aware,smg_cache_aware_tuned \
      --json "$out/$name-seed$s.json" > "$out/$name-seed$s.txt" 2> "$out/$name-seed$s.stderr"
    grep -E '^\| [a-z]' "$out/$name-seed$s.txt" | grep -v '^| policy' | sed "s/^/$name seed$s /"
  done
done
