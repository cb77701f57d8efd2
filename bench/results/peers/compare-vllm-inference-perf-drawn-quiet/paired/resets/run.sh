#!/usr/bin/env bash
# The saturating cell of ../trailer/run.sh (8 groups of 3 users, 16 then 32
# requests/s, two vLLM replicas of 4 slots, default caches) after engine
# connections closed before any answer byte stopped counting as strikes:
# Hearth and PEER (default smg_cache_aware) in turn, seeds FIRST..N (the
# order reversed on even seeds), each Hearth run's replica health at its
# end in the .stderr (and in the JSON's report, `sidecar_state`); from
# seed 6 on, Envoy's own counters too (`envoy_counters`; seed 7's include
# ext_proc's streams, messages and deadline overrides).
# Usage: [PEER=least_request] bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/resets/run.sh [N] [FIRST]
set -euo pipefail
cd "$(dirname "$0")/../../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/resets
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
peer=${PEER:-smg_cache_aware}
start_engines "$out/engines-from${2:-1}-$peer.log" --replicas 2 --max-num-seqs 4 --shared-name-first
for r in $(seq "${2:-1}" "${1:-1}"); do
  name="$peer-seed$r"
  target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
    --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
    --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$r" \
    --policies "hearth,$peer" --json "$out/$name.json" \
    > "$out/$name.txt" 2> "$out/$name.stderr"
  grep -E '^\| [a-z]' "$out/$name.txt" | grep -v '^| policy' | sed "s/^/seed$r /"
  grep -E 'CPU during|replica health' "$out/$name.stderr"
done
