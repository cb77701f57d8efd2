#!/usr/bin/env bash
# The low-rate cell of ../compare-vllm-inference-perf-cpu/ (llm-d's
# shared-prefix workload through inference-perf on two real four-slot
# vLLM replicas started for each seed: Hearth, least_request, smg's
# cache_aware at its defaults and tuned), with Hearth's decision journal
# on and where each group's and user's requests went printed.
# Usage: bench/results/peers/compare-vllm-inference-perf-drawn/run.sh [SEEDS...]
# Summary: python3 bench/results/peers/compare-vllm-inference-perf-cpu/summary.py \
#   bench/results/peers/compare-vllm-inference-perf-drawn > .../summary.txt
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=bench/results/peers/compare-vllm-inference-perf-drawn CELLS=low JOURNAL=1 \
  exec bench/results/peers/compare-vllm-inference-perf-cpu/run.sh "$@"
