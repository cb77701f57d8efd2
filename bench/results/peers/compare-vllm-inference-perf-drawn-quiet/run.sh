#!/usr/bin/env bash
# The low cell of ../compare-vllm-inference-perf-drawn/ again (the same
# script, journal on), on a morning the machine was otherwise idle; with
# CELLS=saturating, the saturating cell after it.
# Usage: [CELLS=low|saturating] bench/results/peers/compare-vllm-inference-perf-drawn-quiet/run.sh [SEEDS...]
# Summary: python3 bench/results/peers/compare-vllm-inference-perf-cpu/summary.py \
#   bench/results/peers/compare-vllm-inference-perf-drawn-quiet > .../summary.txt
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=bench/results/peers/compare-vllm-inference-perf-drawn-quiet CELLS=${CELLS:-low} JOURNAL=1 \
  exec bench/results/peers/compare-vllm-inference-perf-cpu/run.sh "$@"
