#!/usr/bin/env python3
"""Summarises run.sh's runs: per seed, slots kept for tenants under their
fair share alone and with the engine's queue in Hearth's order, the quiet
and noisy tenants' TTFT and the cell's turns/min for each setup.
Usage: summary.py [DIR]"""
import json
import pathlib
import sys

d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent)


def row(rows, mix, setup, cls):
    for r in rows:
        if r["mix"] == mix and r["setup"] == setup and r["class"] == cls:
            return r


print("| seed | run | setup | quiet p50 / p90 s | quiet p90 / alone | noisy p90 s | turns/min | / Hearth without flow control |")
print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
for seed in (1, 2, 3):
    for run in ("slots", "slots-priority"):
        f = d / f"vllm-{run}-seed{seed}.json"
        if not f.exists():
            continue
        rows = json.load(open(f))["rows"]
        alone = row(rows, "quiet_alone", "hearth_flow_control", "quiet")["ttft_p90_s"]
        base = row(rows, "tenants", "hearth_no_flow_control", None)["turns_per_min"]
        # smg's rows failed every request: these engines were started
        # without --shared-name-first, which smg needs (one model name).
        for setup in ("least_request", "hearth_no_flow_control", "hearth_flow_control"):
            q = row(rows, "tenants", setup, "quiet")
            n = row(rows, "tenants", setup, "noisy")
            t = row(rows, "tenants", setup, None)["turns_per_min"]
            print(f"| {seed} | {run} | {setup} | {q['ttft_p50_s']:.2f} / {q['ttft_p90_s']:.2f} | "
                  f"{q['ttft_p90_s'] / alone:.2f}x | {n['ttft_p90_s']:.2f} | {t:.1f} | {t / base:.3f} |")
