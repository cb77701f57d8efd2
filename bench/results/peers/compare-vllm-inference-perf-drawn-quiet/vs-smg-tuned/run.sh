#!/usr/bin/env bash
# The saturating cell (8 groups of 3 users, 16 then 32 requests/s),
# Hearth at its defaults against smg's cache_aware tuned, the two in
# turn on the same two vLLM replicas (started here, emptied before each
# run), seeds 1..N (hearth-bench compare reverses the order on even
# seeds): is smg tuned's lead at saturation more than the drift between
# runs?
# Usage: bench/results/peers/compare-vllm-inference-perf-drawn-quiet/vs-smg-tuned/run.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/vs-smg-tuned
rounds=${1:-2}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --shared-name-first
for r in $(seq "$rounds"); do
  target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
    --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
    --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$r" \
    --policies hearth,smg_cache_aware_tuned --json "$out/seed$r.json" \
    > "$out/seed$r.txt" 2> "$out/seed$r.stderr"
  grep -E '^\| [a-z]' "$out/seed$r.txt" | grep -v '^| policy' | sed "s/^/seed$r /"
done
