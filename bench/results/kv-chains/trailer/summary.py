#!/usr/bin/env python3
"""Per-policy figures of the compares in DIR (seedN.json), with the gateway
CPU each run's stderr reports, and Hearth's margin over ring_hash seed by
seed."""
import json, pathlib, re, sys

d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
rows, cpu = {}, {}
seeds = sorted(int(p.stem[4:]) for p in d.glob("seed*.json"))
for s in seeds:
    for r in json.load(open(d / f"seed{s}.json"))["rows"]:
        rows.setdefault(r["policy"], {})[s] = r
    err = (d / f"seed{s}.stderr").read_text() if (d / f"seed{s}.stderr").exists() else ""
    for m in re.finditer(r"real: (\S+) CPU during the run: (.*)", err):
        total = sum(float(x) for x in re.findall(r"([0-9.]+) s", m.group(2)))
        cpu.setdefault(m.group(1), {})[s] = total

def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")

print("| policy | turns/min by seed | mean | TTFT p90 s by seed | mean | wall s, sum | cached, turns 2+ | stay | gateway CPU s by seed |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for p, by in rows.items():
    tm = [by[s]["turns_per_min"] for s in seeds if s in by]
    p90 = [by[s]["ttft_p90_s"] for s in seeds if s in by]
    wall = sum(by[s]["wall_s"] for s in seeds if s in by)
    cl = mean([by[s]["cached_later"] for s in seeds if s in by])
    st = mean([by[s]["stay_rate"] for s in seeds if s in by])
    c = cpu.get(p, {})
    print(f"| {p} | {' / '.join(f'{x:.1f}' for x in tm)} | {mean(tm):.1f} | "
          f"{' / '.join(f'{x:.2f}' for x in p90)} | {mean(p90):.3f} | {wall:.1f} | {cl:.1%} | {st:.1%} | "
          f"{' / '.join(f'{c[s]:.2f}' for s in seeds if s in c)} |")
if "hearth_kv_events" in rows and "ring_hash" in rows:
    h, r = rows["hearth_kv_events"], rows["ring_hash"]
    both = [s for s in seeds if s in h and s in r]
    ahead = sum(h[s]["turns_per_min"] > r[s]["turns_per_min"] for s in both)
    lower = sum(h[s]["ttft_p90_s"] < r[s]["ttft_p90_s"] for s in both)
    ratio = mean([h[s]["turns_per_min"] / r[s]["turns_per_min"] for s in both])
    print(f"\nHearth with events over ring_hash: turns/min {ratio:.3f}x on the mean of the seeds' ratios, "
          f"ahead on {ahead} of {len(both)} seeds, lower TTFT p90 on {lower} of {len(both)}")
