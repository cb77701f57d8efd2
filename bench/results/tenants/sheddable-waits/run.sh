#!/usr/bin/env bash
# The priority mix with sheddable requests waiting behind the higher band
# (HEARTH_FLOW_SHEDDABLE_WAITS, on by default) against refusing them at once
# (off), and the lower bands' prefill share (HEARTH_FLOW_LOWER_PREFILL_SHARE)
# at 1 (not paced), 0.25 (the default) and 0.1, each beside the real peer,
# smg 1.13.0 with its priority scheduler, with its own high-band-alone
# reference.
#   run.sh sim     simulated engines, seeds 1-3
#   run.sh vllm    two vLLM replicas, seeds 1-3; ENGINES=A,B from
#                  target/release/hearth-bench vllm --replicas 2 --max-num-seqs 4 --shared-name-first
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/tenants/sheddable-waits
bench=target/release/hearth-bench
# name: settings
configs=(
  "refused HEARTH_FLOW_SHEDDABLE_WAITS=false HEARTH_FLOW_LOWER_PREFILL_SHARE=1"
  "waits-share1 HEARTH_FLOW_LOWER_PREFILL_SHARE=1"
  "waits-share0.25 HEARTH_FLOW_LOWER_PREFILL_SHARE=0.25"
  "waits-share0.1 HEARTH_FLOW_LOWER_PREFILL_SHARE=0.1"
)
KIND=$1
for seed in ${SEEDS:-1 2 3}; do
  for c in "${configs[@]}"; do
    set -- $c
    name=$1; shift
    sets=(); for s in "$@"; do sets+=(--set "$s"); done
    case $KIND in
    sim)
      $bench tenants --mix priority --setups hearth_flow_control,smg_priority --seconds 60 \
        --seed "$seed" "${sets[@]}" \
        --json "$out/sim-$name-seed$seed.json" > "$out/sim-$name-seed$seed.txt" ;;
    vllm)
      $bench tenants --engines "$ENGINES" --model llama-4x512 --reset-caches --mix priority \
        --setups hearth_flow_control,smg_priority --seed "$seed" "${sets[@]}" \
        --json "$out/vllm-$name-seed$seed.json" > "$out/vllm-$name-seed$seed.txt" ;;
    esac
  done
done
