#!/usr/bin/env python3
"""Side-by-side figures of run.sh's runs: per seed, for Hearth with flow
control and smg's priority scheduler, the high band's TTFT p90 and its
ratio to the band alone, the sheddable band's p50 / p90 and refusals, the
priority mix's turns/min, and (vLLM) the tenants mix's ratios.
Run from this folder: python3 summary.py > summary.txt"""
import glob
import json
import re

SETUPS = ["hearth_flow_control", "smg_priority", "hearth_no_flow_control", "least_request"]


def row(d, mix, setup, cls):
    for r in d["rows"]:
        if r["mix"] == mix and r["setup"] == setup and r["class"] == cls:
            return r
    return None


def ratio(d, what, setup):
    for r in d["ratios"]:
        if r["what"].startswith(what):
            return dict(r["values"]).get(setup)
    return None


def fmt(x, f="{:.2f}"):
    return "-" if x is None else f.format(x)


for kind in ["sim-priority", "vllm"]:
    files = sorted(glob.glob(f"{kind}-seed*.json"), key=lambda f: int(re.search(r"seed(\d+)", f)[1]))
    if not files:
        continue
    print(f"## {kind}")
    for f in files:
        d = json.load(open(f))
        print(f"### {f} (build {d['build']['build']}, {d['build']['started_utc']})")
        for s in SETUPS:
            high = row(d, "priority", s, "high")
            shed = row(d, "priority", s, "sheddable")
            total = row(d, "priority", s, None)
            if high is None:
                continue
            line = (f"{s:24} high p50/p90 {fmt(high['ttft_p50_s'])}/{fmt(high['ttft_p90_s'])} s "
                    f"({fmt(ratio(d, 'high band', s))}x alone)  "
                    f"sheddable p50/p90 {fmt(shed['ttft_p50_s'])}/{fmt(shed['ttft_p90_s'])} s, "
                    f"429s {shed['rate_limited']}  priority mix {fmt(total['turns_per_min'], '{:.1f}')} turns/min")
            tenants = row(d, "tenants", s, None)
            if tenants is not None:
                line += (f"  | tenants: quiet {fmt(ratio(d, 'quiet', s))}x alone, "
                         f"{fmt(tenants['turns_per_min'], '{:.1f}')} turns/min, cached {tenants['cached_fraction']:.1%}")
            print(line)
        print()
