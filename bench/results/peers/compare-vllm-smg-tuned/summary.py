#!/usr/bin/env python3
"""Per-policy figures of run.sh's runs: turns/min, cached share of later
turns, TTFT p90, stay and the per-engine split, each run and the mean."""
import glob, json, os, statistics

here = os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(here, "bs*-seed*.json"))):
    run = os.path.basename(path)[:-5]
    block = run.split("-")[0][2:]
    for r in json.load(open(path))["rows"]:
        # Only Hearth reads the block size; the others' six runs pool.
        key = f"hearth, block {block} B" if r["policy"] == "hearth" else r["policy"]
        rows.setdefault(key, []).append((run, r))

def split(r):
    n = r.get("per_engine") or []
    return " / ".join(str(x) for x in n) if sum(n) else "-"

print("| policy | runs | turns/min, each run | mean | cached, turns 2+ (mean) | TTFT p90 s (mean) | stay (mean) | per-engine turns, each run |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |")
for policy, runs in rows.items():
    tpm = [r["turns_per_min"] for _, r in runs]
    stays = [r["stay_rate"] for _, r in runs if r.get("stay_rate") is not None]
    print(
        f"| {policy} | {len(runs)} | {', '.join(f'{t:.0f}' for t in tpm)} | {statistics.mean(tpm):.1f} "
        f"| {100 * statistics.mean(r['cached_later'] for _, r in runs):.1f}% "
        f"| {statistics.mean(r['ttft_p90_s'] for _, r in runs):.2f} "
        f"| {('%.1f%%' % (100 * statistics.mean(stays))) if stays else '-'} "
        f"| {'; '.join(split(r) for _, r in runs)} |"
    )
print()
print("runs:", ", ".join(sorted({run for runs in rows.values() for run, _ in runs})))
