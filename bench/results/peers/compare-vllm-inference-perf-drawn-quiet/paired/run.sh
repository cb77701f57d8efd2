#!/usr/bin/env bash
# The saturating cell (8 groups of 3 users, 16 then 32 requests/s) as
# paired runs: Hearth at its defaults against one peer at a time, the two
# in turn on the same two vLLM replicas (started here, emptied before
# each run), for each seed 1..N and each peer in PEERS (hearth-bench
# compare reverses the order on even seeds). At saturation this machine
# drifts by 0.7 requests a second between runs, as much as the routers
# differ, so each peer is judged against the Hearth run beside it.
# Usage: bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/run.sh [N]
#        (PEERS="least_request smg_cache_aware" by default)
set -euo pipefail
cd "$(dirname "$0")/../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired
rounds=${1:-3}
peers=${PEERS:-least_request smg_cache_aware}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --shared-name-first
for r in $(seq "$rounds"); do
  for peer in $peers; do
    target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
      --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
      --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$r" \
      --policies "hearth,$peer" --json "$out/$peer-seed$r.json" \
      > "$out/$peer-seed$r.txt" 2> "$out/$peer-seed$r.stderr"
    grep -E '^\| [a-z]' "$out/$peer-seed$r.txt" | grep -v '^| policy' | sed "s/^/$peer seed$r /"
  done
done
