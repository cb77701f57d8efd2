#!/usr/bin/env bash
# `hearth-bench compare --paired` on two vLLM replicas (started here):
# the agent conversations through Hearth, least_request and ring_hash,
# each peer beside a Hearth run of its own; then the saturating
# shared-prefix cell through inference-perf, Hearth beside least_request
# and beside smg, seeds from SEEDS (default 3); CONVERSATIONS=0 skips
# the first.
# Usage: [SEEDS="1 2"] [CONVERSATIONS=0] bench/results/peers/paired-compare/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/peers/paired-compare
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --shared-name-first
if [[ ${CONVERSATIONS:-1} != 0 ]]; then
  target/release/hearth-bench compare --engines "$ENGINES" --model llama-4x512 --conversations 8 --turns 4 \
    --max-tokens 16 --reset-caches --seed 1 --paired --policies hearth,least_request,ring_hash \
    --json "$out/conversations-seed1.json" > "$out/conversations-seed1.txt" 2> "$out/conversations-seed1.stderr"
fi
for seed in ${SEEDS:-3}; do
  target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
    --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
    --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$seed" --paired \
    --policies hearth,least_request,smg_cache_aware --json "$out/saturating-seed$seed.json" \
    > "$out/saturating-seed$seed.txt" 2> "$out/saturating-seed$seed.stderr"
done
