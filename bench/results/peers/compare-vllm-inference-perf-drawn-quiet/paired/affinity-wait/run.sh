#!/usr/bin/env bash
# The saturating cell, Hearth alone at its defaults and with
# HEARTH_FLOW_AFFINITY_WAIT_SECONDS=0 (a queued request never waits for
# its warm replica while another has room), in turn on the same two vLLM
# replicas, the order reversed on even seeds: does the wait for a warm
# replica widen Hearth's TTFT spread (lower p50, higher p90 than
# least_request in ../run.sh)?
# Usage: bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/affinity-wait/run.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/affinity-wait
rounds=${1:-2}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --shared-name-first
for r in $(seq "$rounds"); do
  runs=(default wait0)
  if (( r % 2 == 0 )); then runs=(wait0 default); fi
  for run in "${runs[@]}"; do
    set_args=()
    if [[ $run == wait0 ]]; then set_args=(--set HEARTH_FLOW_AFFINITY_WAIT_SECONDS=0); fi
    target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
      --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
      --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$r" \
      --policies hearth "${set_args[@]}" --json "$out/$run-seed$r.json" \
      > "$out/$run-seed$r.txt" 2> "$out/$run-seed$r.stderr"
    grep -E '^\| [a-z]' "$out/$run-seed$r.txt" | grep -v '^| policy' | sed "s/^/$run seed$r /"
  done
done
