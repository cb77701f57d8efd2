#!/bin/bash
cd /work/main
tag=$1; shift
extra="$*"
for cfg in "shared-prefix 64 36 144" "shared-prefix 64 60 300" "shared-prefix 16 60 300" "cache-never-fills 64 60 300" "cache-runs-out 128 60 300" "long-context 16 60 300" "long-context 64 60 300" "unique 64 60 300"; do
  set -- $cfg
  for seed in 1 2 3 4; do
    target/release/hearth-bench sim --jobs 1 --scenario $1 --agents $2 --warmup-s $3 --duration-s $4 --seed $seed --policies hearth_relative --json /tmp/lu-$tag.json $extra >/dev/null 2>&1
    python3 -c "
import json;r=json.load(open('/tmp/lu-$tag.json'))['rows'][0]
print('$tag $1/$2/$3 $seed', round(r['turns_per_min'],1), round(r['ttft_p50_s'],3), round(r['ttft_p90_s'],3), round(r['ttft_p99_s'],3), round(r['cached_fraction'],4))"
  done
done
