#!/usr/bin/env python3
"""The runs of run.sh (every [TAG]seedN.json beside this file): each
policy's requests a second, TTFT p90 and cached share per run (by seed,
then file), their means, and in how many of its runs the Hearth run of
the same compare was ahead of it.
Usage: summary.py [DIR]"""
import glob
import json
import os
import re
import statistics
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
runs = {}
hearth_in = {}
for path in sorted(glob.glob(os.path.join(here, "*seed*.json"))):
    seed = int(re.search(r"seed(\d+)\.json$", path).group(1))
    for row in json.load(open(path))["rows"]:
        runs.setdefault(row["policy"], []).append((seed, row, path))
        if row["policy"] == "hearth":
            hearth_in[path] = row

print("| policy | runs | req/s by seed | mean | TTFT p90 s by seed | mean | cached by seed | Hearth ahead in the same run: req/s, p90 | gateway CPU s |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for policy, seen in runs.items():
    seen.sort(key=lambda x: (x[0], x[2]))
    rows = [r for _, r, _ in seen]
    rate = [r["requests_per_s"] for r in rows]
    p90 = [r["ttft_p90_s"] for r in rows]
    cached = [r["cached_share"] or 0 for r in rows]
    cpu = [r["gateway_cpu_s"] or 0 for r in rows]
    ahead = "-"
    if policy != "hearth":
        # Only the rows of one compare (one JSON) ran side by side.
        same = [(hearth_in[path], r) for _, r, path in seen if path in hearth_in]
        faster = sum(1 for h, r in same if h["requests_per_s"] > r["requests_per_s"])
        lower = sum(1 for h, r in same if h["ttft_p90_s"] < r["ttft_p90_s"])
        ahead = f"{faster} of {len(same)}, {lower} of {len(same)}"
    print(
        f"| {policy} | {len(rows)} | {' / '.join(f'{x:.2f}' for x in rate)} | {statistics.mean(rate):.2f} "
        f"| {' / '.join(f'{x:.2f}' for x in p90)} | {statistics.mean(p90):.2f} "
        f"| {' / '.join(f'{100 * x:.1f}%' for x in cached)} | {ahead} "
        f"| {min(cpu):.1f}-{max(cpu):.1f} |"
    )
