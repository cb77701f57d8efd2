#!/usr/bin/env python3
"""Per cell: each seed's rows (requests/s, output tokens/s and the longest
answer inference-perf counted, TTFT p50 / p90 / p99 to the millisecond,
cached share, failures, the router's CPU seconds), then per policy the means over the seeds and Hearth's figures
over the policy's in the same run (req/s: above 1 is Hearth ahead; TTFT
p90: below 1 is Hearth ahead). Usage: summary.py [DIR] (default: this
folder)."""
import glob, json, os, statistics, sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
for cell in ("low", "saturating"):
    runs, longest = {}, {}
    for path in sorted(glob.glob(os.path.join(here, f"{cell}-seed*.json"))):
        seed = path.rsplit("seed", 1)[1][:-5]
        d = json.load(open(path))
        runs[seed] = {r["policy"]: r for r in d["rows"]}
        for rep in d["reports"]:
            out = rep["summary"]["successes"].get("output_len", {})
            longest[seed, rep["policy"]] = out.get("max", float("nan"))
    if not runs:
        continue
    print(f"## {cell}")
    print("| seed | policy | req/s | out tok/s (longest answer counted) | TTFT p50 / p90 / p99 s | cached | failed | router CPU s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for seed, rows in runs.items():
        for p, r in rows.items():
            print(
                f"| {seed} | {p} | {r['requests_per_s']:.2f} | {r['output_tok_per_s']:.1f} ({longest[seed, p]:.0f}) "
                f"| {r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} / {r['ttft_p99_s']:.3f} "
                f"| {100 * r['cached_share']:.1f}% | {r['failed']} | {r['gateway_cpu_s']:.1f} |"
            )
    print()
    print("| policy | seeds | req/s | TTFT p90 s | router CPU s | Hearth / it, req/s (Hearth ahead in) | Hearth / it, TTFT p90 (Hearth ahead or equal in) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    policies = list(next(iter(runs.values())))
    policies.sort(key=lambda p: p != "hearth")
    for p in policies:
        rows = [runs[s][p] for s in runs if p in runs[s]]
        mean = lambda k: statistics.mean(r[k] for r in rows)
        line = f"| {p} | {len(rows)} | {mean('requests_per_s'):.2f} | {mean('ttft_p90_s'):.3f} | {mean('gateway_cpu_s'):.1f} |"
        if p == "hearth":
            line += " - | - |"
        else:
            pairs = [(runs[s]["hearth"], runs[s][p]) for s in runs if p in runs[s] and "hearth" in runs[s]]
            rps = [h["requests_per_s"] / o["requests_per_s"] for h, o in pairs]
            p90 = [h["ttft_p90_s"] / o["ttft_p90_s"] for h, o in pairs]
            line += (
                f" {statistics.mean(rps):.3f} ({sum(x > 1 for x in rps)} of {len(rps)}) |"
                f" {statistics.mean(p90):.3f} ({sum(x <= 1 for x in p90)} of {len(p90)}) |"
            )
        print(line)
    print()
