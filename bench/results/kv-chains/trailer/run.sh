#!/bin/bash
# The 96-block cell of docs/benchmarks.md ("The same 96-block cell at the
# block size its prompts call for"), Hearth with the engines' KV events
# against the session-keyed ring_hash, after the outcome filter's verdict
# moved onto the ext_proc stream: two fresh vLLM replicas of 96 blocks
# with their events, seeds 1-6 (hearth-bench reverses the order on even
# seeds), then the summary.
#
#   bench/results/kv-chains/trailer/run.sh [SEEDS...]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/kv-chains/trailer
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --kv-events --replicas 2 --kv-blocks 96
for S in ${@:-1 2 3 4 5 6}; do
  target/release/hearth-bench compare --engines "$ENGINES" --model llama-4x512 --conversations 16 \
    --turns 8 --max-tokens 32 --reset-caches --seed "$S" --set HEARTH_BLOCK_SIZE=512 \
    --policies hearth_kv_events,ring_hash --json "$out/seed$S.json" > "$out/seed$S.txt" 2> "$out/seed$S.stderr"
done
stop_engines
python3 "$out/summary.py" "$out"
