#!/usr/bin/env python3
"""Per-setup figures of Hearth with the engines' KV events in the runs in
DIR (NAME-seedS.json, or seedS.json as in ../trailer): turns/min, TTFT p90,
cached share of later turns, the prediction error, how much of it came from
decisions whose chosen replica carried 4 or more (and 8 or more) load units,
and how many requests waited in the sidecar's queue."""
import collections, json, pathlib, re, sys

d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
runs = collections.defaultdict(dict)
for p in sorted(d.glob("*seed*.json")):
    name, seed = re.fullmatch(r"(?:(.*)-)?seed(\d+)", p.stem).groups()
    rows = json.load(open(p))["rows"]
    runs[name or "hearth_kv_events"][int(seed)] = next(r for r in rows if r["policy"] == "hearth_kv_events")

def breakdown(row):
    """Mean error per answer, its points from replicas at 4+ and 8+ load
    units, and the requests that waited in the queue."""
    total = at4 = at8 = 0.0
    n = waited = 0
    for x in row["decisions"]:
        s = x.get("served")
        if x.get("wait_ms"):
            waited += 1
        if not s or not s.get("prompt_tokens") or s.get("predicted_cached_tokens") is None:
            continue
        e = abs(s["predicted_cached_tokens"] - s["cached_tokens"]) / s["prompt_tokens"]
        load = next((c["load"] for c in x["candidates"] if c["replica"] == x["chosen"]), 0.0)
        total += e
        at4 += e if load >= 4 else 0.0
        at8 += e if load >= 8 else 0.0
        n += 1
    n = max(n, 1)
    return total / n, at4 / n, at8 / n, waited

print("| setup | seed | turns/min | TTFT p90 s | wall s | cached, turns 2+ | prediction error | of it, chosen replica at 4+ / 8+ load units | waited in the queue |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
errors = collections.defaultdict(list)
for name, by in runs.items():
    for s, r in sorted(by.items()):
        err, at4, at8, waited = breakdown(r)
        errors[name].append(err)
        print(f"| {name} | {s} | {r['turns_per_min']:.1f} | {r['ttft_p90_s']:.2f} | {r['wall_s']:.1f} | "
              f"{r['cached_later']:.1%} | {err:.2%} | {at4:.2%} / {at8:.2%} | {waited} |")
print()
for name, by in runs.items():
    rs = list(by.values())
    m = lambda k: sum(r[k] for r in rs) / len(rs)
    print(f"{name}: {len(rs)} seeds, mean turns/min {m('turns_per_min'):.1f}, TTFT p90 {m('ttft_p90_s'):.3f} s, "
          f"wall {m('wall_s'):.2f} s, cached {m('cached_later'):.1%}, prediction error {sum(errors[name]) / len(errors[name]):.2%}")
