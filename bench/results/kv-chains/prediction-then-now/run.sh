#!/bin/bash
# Whether the 96-block cell's prediction error moved with the code or with
# the machine: the sidecar of commit cb5b9a4 (the index-bound runs of
# 2026-12-06, 4.0-8.5% per answer) against today's, alternated on the same
# two fresh vLLM replicas of 96 blocks with their events, through
# ../index-bound/run.sh (hearth-bench and the filter are today's for both; the
# `# build` line of each .txt names hearth-bench's commit, not the sidecar's).
#
#   OLD=/path/to/cb5b9a4/hearth-ext-proc bench/results/kv-chains/prediction-then-now/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/kv-chains/prediction-then-now
: "${OLD:?}"
cp target/release/hearth-ext-proc "$out/.new-ext-proc"
. bench/results/peers/vllm-engines.sh
trap 'stop_engines; cp "$out/.new-ext-proc" target/release/hearth-ext-proc; rm -f "$out/.new-ext-proc"' EXIT
start_engines "$out/engines.log" --kv-events --replicas 2 --kv-blocks 96
OLD=$OLD NEW="$out/.new-ext-proc" ENGINES=$ENGINES OUT=$out SEEDS="${SEEDS:-1 2 3 4}" \
  bench/results/kv-chains/index-bound/run.sh
