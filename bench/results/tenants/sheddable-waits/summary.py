#!/usr/bin/env python3
"""Side-by-side figures of run.sh's runs: per fleet, configuration and
seed, for Hearth with flow control and smg's priority scheduler in the
same run, the high band's TTFT p90 and its ratio to the band alone, the
sheddable band's TTFT p50 / p90, turns/min and refusals, and the whole
mix's turns/min. Run from this folder: python3 summary.py > summary.txt"""
import glob
import json
import re

CONFIGS = ["refused", "waits-share1", "waits-share0.25", "waits-share0.1", "defaults"]


def row(d, mix, setup, cls):
    for r in d["rows"]:
        if r["mix"] == mix and r["setup"] == setup and r["class"] == cls:
            return r
    return None


def ratio(d, setup):
    for r in d["ratios"]:
        if r["what"].startswith("high band"):
            return dict(r["values"]).get(setup)
    return None


def fmt(x, f="{:.2f}"):
    return "-" if x is None else f.format(x)


def line(d, setup):
    high = row(d, "priority", setup, "high")
    shed = row(d, "priority", setup, "sheddable")
    total = row(d, "priority", setup, None)
    return (f"high p50/p90 {fmt(high['ttft_p50_s'])}/{fmt(high['ttft_p90_s'])} s "
            f"({fmt(ratio(d, setup))}x alone); sheddable p50/p90 "
            f"{fmt(shed['ttft_p50_s'])}/{fmt(shed['ttft_p90_s'])} s, "
            f"{fmt(shed['turns_per_min'], '{:.1f}')} turns/min, 429s {shed['rate_limited']}; "
            f"all {fmt(total['turns_per_min'], '{:.1f}')} turns/min")


for fleet in ["sim", "vllm"]:
    for config in CONFIGS:
        files = sorted(glob.glob(f"{fleet}-{config}-seed*.json"),
                       key=lambda f: int(re.search(r"seed(\d+)", f)[1]))
        if not files:
            continue
        print(f"## {fleet}, {config}")
        ratios = []
        for f in files:
            d = json.load(open(f))
            print(f"### {f} (build {d['build']['build']}, {d['build']['started_utc']})")
            print(f"hearth_flow_control  {line(d, 'hearth_flow_control')}")
            print(f"smg_priority         {line(d, 'smg_priority')}")
            ratios.append((ratio(d, "hearth_flow_control"), ratio(d, "smg_priority")))
        print("high band ratio, seeds in order: Hearth "
              + " / ".join(fmt(h) for h, _ in ratios) + "; smg "
              + " / ".join(fmt(s) for _, s in ratios))
        print()
