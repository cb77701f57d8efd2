#!/bin/bash
# Hearth with the engines' KV events, one sidecar build against another, on
# the same two vLLM replicas (96 blocks of 128 tokens each, their events on):
# the 96-block cell of docs/benchmarks.md at 512-byte fingerprint blocks,
# seeds 1-6, the order of the two builds reversed on even seeds.
#
#   target/release/hearth-bench vllm --kv-events --replicas 2 --kv-blocks 96   # prints A,B
#   OLD=/path/to/hearth-ext-proc NEW=/path/to/hearth-ext-proc ENGINES=A,B OUT=dir \
#     bench/results/kv-chains/index-bound/run.sh
#
# hearth-bench starts the hearth-ext-proc next to it, so each run copies the
# build it measures there first (and NEW back at the end).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
: "${OLD:?}" "${NEW:?}" "${ENGINES:?}" "${OUT:?}"
mkdir -p "$OUT"
for S in ${SEEDS:-1 2 3 4 5 6}; do
  if [ $((S % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for v in $order; do
    if [ "$v" = old ]; then bin=$OLD; else bin=$NEW; fi
    cp "$bin" target/release/hearth-ext-proc
    target/release/hearth-bench compare --engines "$ENGINES" --model llama-4x512 --conversations 16 \
      --turns 8 --max-tokens 32 --reset-caches --seed "$S" --set HEARTH_BLOCK_SIZE=512 \
      --policies hearth_kv_events --json "$OUT/run-$v-$S.json" > "$OUT/run-$v-$S.txt"
  done
done
cp "$NEW" target/release/hearth-ext-proc
python3 "$(dirname "$0")/summary.py" "$OUT"
