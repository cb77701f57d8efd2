#!/usr/bin/env python3
"""The quiet tenants' TTFT p90 beside the noisy tenant over their figure
alone, per router, and their mean TTFT so (steadier than a p90 of 32
turns), from the runs in DIR (noisyN-seedS.json); prints summary.txt."""
import json, pathlib, re, sys

d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
print("| noisy agents | seed | quiet p90 alone s | least_request | Hearth, no flow control | Hearth, flow control | mean TTFT, Hearth fc / alone | turns/min, all: least_request / Hearth fc |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
runs = []
for p in d.glob("noisy*-seed*.json"):
    noisy, seed = map(int, re.fullmatch(r"noisy(\d+)-seed(\d+)", p.stem).groups())
    runs.append((noisy, seed, json.load(open(p))))
for noisy, seed, run in sorted(runs, key=lambda r: r[:2]):
    ratio = dict(next(r for r in run["ratios"] if r["what"].startswith("quiet tenants"))["values"])
    row = lambda mix, setup, cls: next(r for r in run["rows"] if (r["mix"], r["setup"], r["class"]) == (mix, setup, cls))
    alone = row("quiet_alone", "hearth_flow_control", "quiet")["ttft_p90_s"]
    turns = [row("tenants", s, None)["turns_per_min"] for s in ("least_request", "hearth_flow_control")]
    cells = " | ".join(f"{ratio[k]:.2f}x" for k in ("least_request", "hearth_no_flow_control", "hearth_flow_control"))
    def mean_ttft(cell):
        ts = [x["record"]["ttft_s"] for x in run["records"][cell] if x["class"] == "quiet" and x["record"]["ttft_s"]]
        return sum(ts) / len(ts)
    mean = mean_ttft("tenants under hearth, flow control") / mean_ttft("quiet alone under hearth, flow control")
    print(f"| {noisy} | {seed} | {alone:.2f} | {cells} | {mean:.2f}x | {turns[0]:.1f} / {turns[1]:.1f} |")
