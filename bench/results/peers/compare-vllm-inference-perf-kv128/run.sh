#!/usr/bin/env bash
# The saturating shared-prefix cell (8 groups of 3 users, 1,500 + 300
# tokens, 16 then 32 requests/s) on two vLLM replicas whose KV caches
# hold 128 blocks of 128 tokens each (16,384 tokens): the 24 prompts'
# 19,200 distinct tokens fit in the two caches together but not in
# either one, as the llm-d project's published run overflows one
# replica's cache. With vLLM's default 1,024 blocks each replica holds
# every prompt and no router can save a prefill. Hearth, Envoy
# least_request and smg cache_aware in one compare per seed (the order
# reversed on even seeds), seeds 1..N, each run kept (--keep, in KEEP, by
# default /tmp/hearth-kv128-keep) and its timeline written here
# (scripts/harness-timeline).
# Other policies: POLICIES=hearth,... TAG=name- (their files are
# TAGseedN.*, so each compare keeps its own Hearth run beside them).
# Usage: bench/results/peers/compare-vllm-inference-perf-kv128/run.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=bench/results/peers/compare-vllm-inference-perf-kv128
rounds=${1:-3}
policies=${POLICIES:-hearth,least_request,smg_cache_aware}
keep=${KEEP:-/tmp/hearth-kv128-keep}
tag=${TAG:-}
. bench/results/peers/vllm-engines.sh
trap stop_engines EXIT
start_engines "$out/engines.log" --replicas 2 --max-num-seqs 4 --kv-blocks 128 --shared-name-first
for r in $(seq "$rounds"); do
  target/release/hearth-bench compare --driver inference-perf --engines "$ENGINES" --model llama-4x512 \
    --conversations 24 --users-per-group 3 --system-tokens 1500 --question-tokens 300 \
    --max-tokens 32 --rates 16,32 --stage-seconds 30 --reset-caches --seed "$r" \
    --policies "$policies" --keep "$keep/${tag}seed$r" --json "$out/${tag}seed$r.json" \
    > "$out/${tag}seed$r.txt" 2> "$out/${tag}seed$r.stderr"
  scripts/harness-timeline "$keep/${tag}seed$r"/* > "$out/${tag}timeline-seed$r.txt"
  grep -E '^\| [a-z]' "$out/${tag}seed$r.txt" | grep -v '^| policy' | sed "s/^/${tag}seed$r /"
done
