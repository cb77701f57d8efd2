#!/usr/bin/env bash
# llm-d's shared-prefix workload through its own harness (inference-perf)
# on two real four-slot vLLM replicas started just before each seed, the
# low-rate cell only (4 groups of 3 users, 2 then 8 requests/s, as in
# ../compare-vllm-inference-perf-cpu/): Hearth at its defaults with its
# decision journal (where each group's requests went: groups.py), Envoy
# least_request and smg's cache_aware (defaults and tuned).
# Engines: each seed starts its own (target/release/hearth-bench vllm
# --replicas 2 --max-num-seqs 4 --shared-name-first) and stops them after;
# ENGINES=A,B uses running ones instead.
# Usage: bench/results/peers/compare-vllm-inference-perf-drawn/run.sh [SEEDS...]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/peers/compare-vllm-inference-perf-drawn
seeds=("$@"); [ ${#seeds[@]} -eq 0 ] && seeds=(1 2 3)
given=${ENGINES:-}
engines_pid=
stop_engines() { [ -n "$engines_pid" ] && kill -- "-$engines_pid" 2>/dev/null; engines_pid=; }
trap stop_engines EXIT
for s in "${seeds[@]}"; do
  if [ -z "$given" ]; then
    log="$out/engines-seed$s.log"
    setsid target/release/hearth-bench vllm --replicas 2 --max-num-seqs 4 --shared-name-first > "$log" 2>&1 &
    engines_pid=$!
    for _ in $(seq 600); do
      ENGINES=$(tail -1 "$log" | grep -E '^127\.0\.0\.1:[0-9]+,127\.0\.0\.1:[0-9]+$' || true)
      [ -n "$ENGINES" ] && break
      kill -0 "$engines_pid" 2>/dev/null || { cat "$log"; exit 1; }
      sleep 1
    done
    [ -n "$ENGINES" ] || { echo "engines not up after 600 s" >&2; exit 1; }
  fi
  journal="$out/journal-low-seed$s.jsonl"
  rm -f "$journal"
  target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
    --conversations 12 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
    --max-tokens 32 --rates 2,8 --stage-seconds 30 --reset-caches --seed "$s" \
    --policies hearth,least_request,smg_cache_aware,smg_cache_aware_tuned \
    --set "HEARTH_JOURNAL_FILE=$PWD/$journal" \
    --json "$out/low-seed$s.json" > "$out/low-seed$s.txt" 2> "$out/low-seed$s.stderr"
  grep -E '^\| [a-z]' "$out/low-seed$s.txt" | grep -v '^| policy' | sed "s/^/low seed$s /"
  python3 "$out/../compare-vllm-inference-perf-smg/hearth-journal/groups.py" "$journal" | sed "s/^/  hearth seed$s /"
  [ -z "$given" ] && stop_engines
done
