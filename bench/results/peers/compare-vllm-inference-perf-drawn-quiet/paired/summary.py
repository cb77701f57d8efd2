#!/usr/bin/env python3
"""Pairs of ../paired/run.sh (and of any directory of PEER-seedN.txt files
written by hearth-bench compare with two policies, Hearth first or second):
each peer against the Hearth run beside it, per seed, then means.
Usage: summary.py [DIR]"""
import glob
import os
import re
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(here, "*-seed*.txt"))):
    name = os.path.basename(path)[: -len(".txt")]
    peer, seed = re.match(r"(.+)-seed(\d+)$", name).groups()
    order, table = [], {}
    for line in open(path):
        if line.startswith("# order"):
            order = line.split(":", 1)[1].strip().split(",")
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 11 and cells[0] not in ("policy",) and not cells[0].startswith("-"):
            table[cells[0]] = cells
    rows.setdefault(peer, []).append((int(seed), order, table))

print("| peer | seed | ran first | req/s: Hearth / peer | TTFT p50 s: Hearth / peer | TTFT p90 s: Hearth / peer | gateway CPU s: Hearth / peer |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
means = {}
for peer, runs in rows.items():
    for seed, order, t in sorted(runs):
        h, p = t["hearth"], t[order[0] if order[0] != "hearth" else order[1]]
        first = order[0] if order else "?"
        print(f"| {p[0]} | {seed} | {first} | {h[4]} / {p[4]} | {h[6]} / {p[6]} | {h[7]} / {p[7]} | {h[10]} / {p[10]} |")
        m = means.setdefault(p[0], [])
        m.append(tuple(float(x) for x in (h[4], p[4], h[6], p[6], h[7], p[7])))
print()
print("| peer | seeds | req/s means: Hearth / peer (Hearth ahead in) | TTFT p90 means: Hearth / peer (Hearth lower in) | TTFT p50 means: Hearth / peer |")
print("| --- | ---: | ---: | ---: | ---: |")
for peer, m in means.items():
    n = len(m)
    avg = [sum(r[i] for r in m) / n for i in range(6)]
    ahead = sum(1 for r in m if r[0] > r[1])
    lower = sum(1 for r in m if r[4] < r[5])
    print(f"| {peer} | {n} | {avg[0]:.2f} / {avg[1]:.2f} ({ahead} of {n}) | {avg[4]:.2f} / {avg[5]:.2f} ({lower} of {n}) | {avg[2]:.2f} / {avg[3]:.2f} |")
