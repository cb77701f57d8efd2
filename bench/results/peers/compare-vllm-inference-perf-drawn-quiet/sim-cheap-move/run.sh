#!/usr/bin/env bash
# The simulator's scenarios with one binary, seeds 1-4, Hearth only: a line
# per run: TAG scenario seed agents turns/min e2e-p50-s cached%.
# (The 4-block runs listed long-context, long-lane, cache-never-fills and
# shared-prefix only, and printed the TTFT p99 in the sixth column.)
# Usage: run.sh BINARY TAG > FILE; compare: python3 cmp.py BEFORE AFTER
bin=$1; tag=$2
for sc in shared-prefix long-context unique cache-never-fills cache-runs-out long-lane fleet; do
  for seed in 1 2 3 4; do
    "$bin" sim --scenario $sc --policies hearth_relative --seed $seed --jobs 2 2>/dev/null \
     | awk -v sc=$sc -v seed=$seed -v tag="$tag" '$1=="hearth_relative" && NF>15 {print tag, sc, seed, $2, $4, $14, $6}'
  done
done
