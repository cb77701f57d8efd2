#!/usr/bin/env python3
"""Summarises the engine-priority runs: per seed, with and without
HEARTH_ENGINE_PRIORITY, the classes' TTFT and the cells' turns/min."""
import json, sys, pathlib
d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
def row(rows, mix, setup, cls):
    for r in rows:
        if r["mix"] == mix and r["setup"] == setup and r["class"] == cls:
            return r
print("| seed | run | setup | quiet p50 / p90 / p99 | noisy p50 / p90 / p99 | tenants turns/min | high p50 / p90 / p99 | batch p90 / p99, 429s | priority turns/min | quiet ratio | high ratio |")
print("|---|---|---|---|---|---:|---|---|---:|---:|---:|")
for seed in (1, 2, 3):
    for run in ("off", "on"):
        f = d / f"vllm-{run}-seed{seed}.json"
        if not f.exists():
            continue
        j = json.load(open(f))
        rows = j["rows"]
        ratios = j["ratios"]
        for setup in ("hearth_no_flow_control", "hearth_flow_control"):
            q = row(rows, "tenants", setup, "quiet"); n = row(rows, "tenants", setup, "noisy")
            ta = row(rows, "tenants", setup, None); h = row(rows, "priority", setup, "high")
            b = row(rows, "priority", setup, "sheddable"); pa = row(rows, "priority", setup, None)
            t = lambda r: f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} / {r['ttft_p99_s']:.2f}"
            qa = row(rows, "quiet_alone", "hearth_flow_control", "quiet")
            ha = row(rows, "high_alone", "hearth_flow_control", "high")
            print(f"| {seed} | {run} | {setup} | {t(q)} | {t(n)} | {ta['turns_per_min']:.1f} | {t(h)} | "
                  f"{b['ttft_p90_s']:.2f} / {b['ttft_p99_s']:.2f}, {b['rate_limited']} | {pa['turns_per_min']:.1f} | "
                  f"{q['ttft_p90_s']/qa['ttft_p90_s']:.2f}x | {h['ttft_p90_s']/ha['ttft_p90_s']:.2f}x |")
