#!/usr/bin/env bash
# The tenants mix on two vLLM replicas that schedule by priority, with
# slots kept for tenants under their fair share for 2 s
# (HEARTH_FLOW_FAIR_SLOTS_SECONDS=2), alone ("slots") and with the
# engine's queue in Hearth's order as well
# (HEARTH_ENGINE_PRIORITY=lower-first, "slots-priority"), the order
# alternated by seed; the engines are started here.
# Usage: bench/results/tenants/fairslots-engine-priority/run.sh   (SEEDS="1 2 3")
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/tenants/fairslots-engine-priority
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --priority-scheduling
for seed in ${SEEDS:-1 2 3}; do
  runs=(slots-priority slots)
  if (( seed % 2 == 0 )); then runs=(slots slots-priority); fi
  for run in "${runs[@]}"; do
    set_args=(--set HEARTH_FLOW_FAIR_SLOTS_SECONDS=2)
    if [[ $run == slots-priority ]]; then set_args+=(--set HEARTH_ENGINE_PRIORITY=lower-first); fi
    target/release/hearth-bench tenants --engines "$ENGINES" --model llama-4x512 --reset-caches \
      --mix tenants --seed "$seed" "${set_args[@]}" --json "$out/vllm-$run-seed$seed.json" \
      > "$out/vllm-$run-seed$seed.txt" 2>&1
    echo "seed $seed $run done $(date -u +%H:%M:%S)"
  done
done
