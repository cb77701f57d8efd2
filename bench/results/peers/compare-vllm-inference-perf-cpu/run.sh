#!/usr/bin/env bash
# llm-d's shared-prefix workload through its own harness (inference-perf)
# on two real four-slot vLLM replicas started just before: Hearth at its
# defaults, Envoy least_request and smg's cache_aware (defaults and
# tuned), with each router's CPU during the run (the table's last
# column, the split on stderr). The low-rate cell (4 groups of 3 users,
# 2 then 8 requests/s) and the saturating one (8 groups, 16 then 32
# requests/s), as in ../compare-vllm-inference-perf-smg/.
# Engines: each seed starts its own (target/release/hearth-bench vllm
# --replicas 2 --max-num-seqs 4 --shared-name-first) and stops them after;
# ENGINES=A,B uses running ones instead. OUT=DIR writes the runs there
# instead of here, CELLS=low (or saturating) runs one cell only, and
# JOURNAL=1 turns Hearth's decision journal on (DIR/journal-CELL-seedS.jsonl)
# and prints where each group's and user's requests went.
# Usage: bench/results/peers/compare-vllm-inference-perf-cpu/run.sh [SEEDS...]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=bench/results/peers/compare-vllm-inference-perf-cpu
out=${OUT:-$here}
cells=${CELLS:-saturating low}
seeds=("$@"); [ ${#seeds[@]} -eq 0 ] && seeds=(1 2 3)
given=${ENGINES:-}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
for s in "${seeds[@]}"; do
  if [ -z "$given" ]; then
    start_engines "$out/engines-seed$s.log" --replicas 2 --max-num-seqs 4 --shared-name-first
  fi
  for cell in "saturating 24 16,32" "low 12 2,8"; do
    read -r name users rates <<< "$cell"
    [[ " $cells " == *" $name "* ]] || continue
    journal=()
    if [ "${JOURNAL:-0}" = 1 ]; then
      rm -f "$out/journal-$name-seed$s.jsonl"
      journal=(--set "HEARTH_JOURNAL_FILE=$PWD/$out/journal-$name-seed$s.jsonl")
    fi
    target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
      --conversations "$users" --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
      --max-tokens 32 --rates "$rates" --stage-seconds 30 --reset-caches --seed "$s" \
      --policies hearth,least_request,smg_cache_aware,smg_cache_aware_tuned "${journal[@]}" \
      --json "$out/$name-seed$s.json" > "$out/$name-seed$s.txt" 2> "$out/$name-seed$s.stderr"
    grep -E '^\| [a-z]' "$out/$name-seed$s.txt" | grep -v '^| policy' | sed "s/^/$name seed$s /"
    if [ "${JOURNAL:-0}" = 1 ]; then
      python3 bench/results/peers/compare-vllm-inference-perf-smg/hearth-journal/groups.py \
        "$out/journal-$name-seed$s.jsonl" | sed "s/^/  hearth $name seed$s /"
      python3 "$here/users.py" "$out/journal-$name-seed$s.jsonl" | sed "s/^/  hearth $name seed$s /"
    fi
  done
  [ -z "$given" ] && stop_engines
done
