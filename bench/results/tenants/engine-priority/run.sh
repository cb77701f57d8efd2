#!/usr/bin/env bash
# Both tenants mixes on two vLLM replicas that schedule by priority, with
# and without HEARTH_ENGINE_PRIORITY=lower-first, the order alternated by
# seed. ENGINES=A,B from:
#   target/release/hearth-bench vllm --replicas 2 --max-num-seqs 4 --priority-scheduling
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/tenants/engine-priority
for seed in ${SEEDS:-1 2 3}; do
  runs=("on" "off")
  if (( seed % 2 == 0 )); then runs=("off" "on"); fi
  for run in "${runs[@]}"; do
    set_args=()
    if [[ $run == on ]]; then set_args=(--set HEARTH_ENGINE_PRIORITY=lower-first); fi
    target/release/hearth-bench tenants --engines "$ENGINES" --model llama-4x512 --reset-caches \
      --seed "$seed" "${set_args[@]}" --json "$out/vllm-$run-seed$seed.json" \
      > "$out/vllm-$run-seed$seed.txt" 2>&1
  done
done
