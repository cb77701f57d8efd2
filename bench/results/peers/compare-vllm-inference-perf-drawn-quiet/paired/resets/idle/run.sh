#!/usr/bin/env bash
# Hearth alone on the saturating cell of ../run.sh, two builds alternated
# on the same engines: Envoy closing an idle engine connection after 3 s
# (render::ENGINE_IDLE_SECONDS as committed) and after 1 s (the same tree
# with that constant at 1), for the requests lost to "connection
# termination" 503s. BUILDS names the two folders holding each build's
# hearth-bench and hearth-ext-proc, as NAME=DIR,NAME=DIR.
# Usage: BUILDS=idle3=/tmp/idle3,idle1=/tmp/idle1 .../paired/resets/idle/run.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../../../../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn-quiet/paired/resets/idle
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
IFS=, read -r -a builds <<< "${BUILDS:?name=dir,name=dir}"
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --shared-name-first
for r in $(seq 1 "${1:-3}"); do
  order=("${builds[@]}")
  if (( r % 2 == 0 )); then order=("${builds[1]}" "${builds[0]}"); fi
  for b in "${order[@]}"; do
    name="${b%%=*}-seed$r"
    "${b#*=}/hearth-bench" compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
      --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
      --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$r" \
      --policies hearth --json "$out/$name.json" > "$out/$name.txt" 2> "$out/$name.stderr"
    grep -E '^\| [a-z]' "$out/$name.txt" | grep -v '^| policy' | sed "s/^/$name /"
    grep -E 'replica health' "$out/$name.stderr" | sed "s/^/$name /"
  done
done
