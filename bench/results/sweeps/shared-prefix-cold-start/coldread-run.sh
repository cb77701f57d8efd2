#!/bin/bash
# The simulator's side of "New prompts placed by the reading ahead of them"
# (docs/benchmarks.md): Hearth (hearth_relative) alone, at its defaults
# (HEARTH_COLD_READ_WEIGHT=1, tagged "new") and with the setting at 0 (the
# rule before it, tagged "off"). One line per cell and seed: tag,
# scenario/agents[/warm-up s], seed, turns/min, TTFT p50, p90, p99 (s),
# cached share. Run from the repository root after
# `cargo build --release -p hearth-bench`.
#   coldread-run.sh window     -> coldread-36-144.txt (seeds 1-4)
#   coldread-run.sh scenarios  -> coldread-scenarios.txt (seeds 1-4)
#   coldread-run.sh long       -> coldread-long-context-40-seeds.txt
set -e
bench=target/release/hearth-bench
json=$(mktemp)
row() { # tag cell seed
  python3 -c "
import json, sys
for r in json.load(open('$json'))['rows']:
    print('$1 $2' + ('/' + str(r['agents']) if '$4' else '') + ' $3', round(r['turns_per_min'], 1), round(r['ttft_p50_s'], 3),
          round(r['ttft_p90_s'], 3), round(r['ttft_p99_s'], 3), round(r['cached_fraction'], 4))"
}
for tag in off new; do
  set_off=(); [ $tag = off ] && set_off=(--set HEARTH_COLD_READ_WEIGHT=0)
  case $1 in
  window)
    for seed in 1 2 3 4; do
      $bench sim --jobs 1 --scenario shared-prefix --agents 64 --warmup-s 36 --duration-s 144 --seed $seed \
        --policies hearth_relative --json $json "${set_off[@]}" >/dev/null
      row $tag shared-prefix/64/36 $seed
    done ;;
  scenarios)
    for sc in cache-never-fills cache-runs-out undersized-kv engine-restart bypass fleet shared-prefix unique long-context long-lane; do
      for seed in 1 2 3 4; do
        $bench sim --jobs 1 --scenario $sc --seed $seed --policies hearth_relative --json $json "${set_off[@]}" >/dev/null
        row $tag $sc $seed per-agents
      done
    done ;;
  long)
    for agents in 16 64; do
      for seed in $(seq 1 40); do
        $bench sim --jobs 1 --scenario long-context --agents $agents --warmup-s 60 --duration-s 300 --seed $seed \
          --policies hearth_relative --json $json "${set_off[@]}" >/dev/null
        row $tag long-context/$agents/60 $seed
      done
    done ;;
  esac
done
rm -f $json
