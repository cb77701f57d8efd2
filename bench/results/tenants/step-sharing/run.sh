#!/usr/bin/env bash
# What the engine's shared steps alone cost the quiet tenants: the tenants
# mix with one agent per quiet tenant beside a "noisy" tenant of only
# NOISY agents (4 by default: 4 + 4 agents on two replicas of four slots),
# so no request waits for a slot under any router and each engine runs
# about four sequences; against the quiet tenants alone, that ratio is
# what a router that never lets an engine's slot idle can at best reach
# here. Two vLLM replicas of four slots, started here.
# Usage: [SEEDS="1 2"] [NOISY=4] bench/results/tenants/step-sharing/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/tenants/step-sharing
noisy=${NOISY:-4}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines-noisy$noisy.log" --replicas 2 --max-num-seqs 4
for seed in ${SEEDS:-1 2}; do
  target/release/hearth-bench tenants --engines "$ENGINES" --model llama-4x512 --reset-caches \
    --mix tenants --quiet-agents 1 --noisy-agents "$noisy" --seed "$seed" \
    --json "$out/noisy$noisy-seed$seed.json" > "$out/noisy$noisy-seed$seed.txt" 2>&1
  echo "seed $seed done $(date -u +%H:%M:%S)"
done
