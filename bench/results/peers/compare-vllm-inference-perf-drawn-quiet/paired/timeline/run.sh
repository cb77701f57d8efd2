#!/usr/bin/env bash
# One pair of the saturating cell (Hearth at its defaults and Envoy
# least_request, in turn on two vLLM replicas of four slots, started
# here), each run kept (--keep, in KEEP, by default
# /tmp/hearth-timeline-keep) with every request's timings and Hearth's
# decision journal, and its timeline written here
# (scripts/harness-timeline). With SAMPLE=1, each engine's running and
# waiting requests are also read every half second (engine-sampler.py;
# each look costs the engine's API server about 8 ms of CPU).
# Usage: bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/timeline/run.sh SEED
set -euo pipefail
cd "$(dirname "$0")/../../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/timeline
seed=${1:?seed}
keep=${KEEP:-/tmp/hearth-timeline-keep}/seed$seed
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --shared-name-first
if [ "${SAMPLE:-0}" = 1 ]; then
  "$out/engine-sampler.py" "$ENGINES" "$out/engines-seed$seed.jsonl" 420 &
fi
target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
  --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
  --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$seed" \
  --policies hearth,least_request --keep "$keep" --json "$out/seed$seed.json" \
  > "$out/seed$seed.txt" 2> "$out/seed$seed.stderr"
scripts/harness-timeline "$keep"/* > "$out/timeline-seed$seed.txt"
