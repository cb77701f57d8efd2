#!/usr/bin/env bash
# The saturating cell (8 groups of 3 users, 16 then 32 requests/s) with
# Hearth at its defaults and with HEARTH_FLOW_CONTROL=false, alternated
# on the same two vLLM replicas (started here, emptied before each run):
# does the sidecar's queue cost throughput at saturation?
# Usage: bench/results/peers/compare-vllm-inference-perf-drawn-quiet/flow-off/run.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/flow-off
rounds=${1:-2}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --shared-name-first
for r in $(seq "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then order="on off"; else order="off on"; fi
  for v in $order; do
    set_flow=(); [ "$v" = off ] && set_flow=(--set HEARTH_FLOW_CONTROL=false)
    target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
      --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
      --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed 1 \
      --policies hearth "${set_flow[@]}" --json "$out/flow-$v-round$r.json" \
      > "$out/flow-$v-round$r.txt" 2> "$out/flow-$v-round$r.stderr"
    grep -E '^\| [a-z]' "$out/flow-$v-round$r.txt" | grep -v '^| policy' | sed "s/^/round$r flow-$v /"
  done
done
