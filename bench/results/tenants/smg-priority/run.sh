#!/usr/bin/env bash
# Issue 33's cells with the real peer beside Hearth: smg 1.13.0 with its
# priority scheduler (policy smg_priority), in the same run as Envoy
# least_request and Hearth without and with flow control.
#   run.sh sim     simulated engines, the priority mix, seeds 1-3
#   run.sh vllm    two vLLM replicas, both mixes, seeds 1-3; ENGINES=A,B from
#                  target/release/hearth-bench vllm --replicas 2 --max-num-seqs 4 --shared-name-first
#                  (smg registers a worker under the first model name it lists only)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/tenants/smg-priority
bench=target/release/hearth-bench
for seed in ${SEEDS:-1 2 3}; do
  case $1 in
  sim)
    $bench tenants --mix priority --seconds 60 --seed "$seed" \
      --json "$out/sim-priority-seed$seed.json" > "$out/sim-priority-seed$seed.txt" ;;
  vllm)
    $bench tenants --engines "$ENGINES" --model llama-4x512 --reset-caches --seed "$seed" \
      --json "$out/vllm-seed$seed.json" > "$out/vllm-seed$seed.txt" ;;
  esac
done
