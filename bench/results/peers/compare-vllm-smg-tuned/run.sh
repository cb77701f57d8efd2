#!/usr/bin/env bash
# Hearth beside smg's cache_aware at its defaults and tuned as smg's docs
# advise for hot spots, Envoy least_request and vllm-router's
# consistent_hash, on two real vLLM replicas whose caches never fill.
# Engines: target/release/hearth-bench vllm --replicas 2 --max-num-seqs 4 --shared-name-first
# Usage: ENGINES=A,B bench/results/peers/compare-vllm-smg-tuned/run.sh [SEEDS...]
# Each seed runs twice: Hearth at its default block size (2048 bytes) and
# at 512 (what docs/settings.md advises for prompts of a few KB).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/peers/compare-vllm-smg-tuned
seeds=("$@"); [ ${#seeds[@]} -eq 0 ] && seeds=(1 2 3)
for s in "${seeds[@]}"; do
  for bs in 2048 512; do
    target/release/hearth-bench compare --engines "$ENGINES" --model llama-4x512 \
      --conversations 16 --turns 12 --max-tokens 32 --reset-caches --seed "$s" \
      --set HEARTH_BLOCK_SIZE=$bs \
      --policies hearth,least_request,smg_cache_aware,smg_cache_aware_tuned,vllm_router_consistent_hash \
      --json "$out/bs$bs-seed$s.json" > "$out/bs$bs-seed$s.txt" 2> "$out/bs$bs-seed$s.stderr"
    grep -E '^\| [a-z]' "$out/bs$bs-seed$s.txt" | grep -v '^| policy' | sed "s/^/bs$bs seed$s /"
  done
done
