#!/usr/bin/env bash
# The saturating cell of ../run.sh (8 groups of 3 users, 16 then 32
# requests/s, two vLLM replicas of 4 slots, default caches) after the
# outcome filter's verdict moved onto the ext_proc stream: Hearth and
# least_request (or PEER, another policy of hearth-bench compare, its
# files named PEER-seedN) in turn, seeds 1..N (the order reversed on even
# seeds), for the gateway CPU each run reports beside the figures.
# Usage: [PEER=smg_cache_aware] bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/trailer/run.sh [N] [FIRST]
# (seeds FIRST..N; FIRST defaults to 1)
set -euo pipefail
cd "$(dirname "$0")/../../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/trailer
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
peer=${PEER:-least_request}
name() { if [ "$peer" = least_request ]; then echo "seed$1"; else echo "$peer-seed$1"; fi; }
start_engines "$out/engines${2:+-from$2}${PEER:+-$PEER}.log" --replicas 2 --max-num-seqs 4 --shared-name-first
for r in $(seq "${2:-1}" "${1:-1}"); do
  target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
    --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
    --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$r" \
    --policies "hearth,$peer" --json "$out/$(name "$r").json" \
    > "$out/$(name "$r").txt" 2> "$out/$(name "$r").stderr"
  grep -E '^\| [a-z]' "$out/$(name "$r").txt" | grep -v '^| policy' | sed "s/^/seed$r /"
  grep 'CPU during' "$out/$(name "$r").stderr"
done
