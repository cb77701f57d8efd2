#!/bin/bash
# The 96-block cell of docs/benchmarks.md ("The same 96-block cell at the
# block size its prompts call for"), Hearth with the engines' KV events
# alone, at the defaults and with its requests held in the sidecar's
# queue while the engines have anything waiting
# (HEARTH_FLOW_ENGINE_WAITING=VALUE, so each is decided when a slot frees):
# two fresh vLLM replicas of 96 blocks with their events, seeds 1..N, the
# order reversed on even seeds, then the summary.
#
#   bench/results/kv-chains/late-dispatch/run.sh [N] [VALUE]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/kv-chains/late-dispatch
value=${2:-1}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --kv-events --replicas 2 --kv-blocks 96
run() { # NAME SEED [--set ...]
  local name=$1 seed=$2; shift 2
  target/release/hearth-bench compare --engines "$ENGINES" --model llama-4x512 --conversations 16 \
    --turns 8 --max-tokens 32 --reset-caches --seed "$seed" --set HEARTH_BLOCK_SIZE=512 "$@" \
    --policies hearth_kv_events --json "$out/$name-seed$seed.json" \
    > "$out/$name-seed$seed.txt" 2> "$out/$name-seed$seed.stderr"
  grep -h 'prediction_error' "$out/$name-seed$seed.txt" | sed "s/^/$name seed$seed /"
}
for S in $(seq "${1:-3}"); do
  if (( S % 2 )); then
    run defaults "$S"; run "waiting$value" "$S" --set "HEARTH_FLOW_ENGINE_WAITING=$value"
  else
    run "waiting$value" "$S" --set "HEARTH_FLOW_ENGINE_WAITING=$value"; run defaults "$S"
  fi
done
stop_engines
python3 "$out/summary.py" "$out"
