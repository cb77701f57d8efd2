#!/usr/bin/env python3
"""Per build and seed: turns/min, TTFT p90, wall, cached share of later
turns, and the sidecar's mean prediction error (|predicted - served| /
prompt tokens, from the decisions in the JSON), then the means; and where
the prediction error lies (as scripts/prediction-breakdown splits it)."""
import collections
import glob
import json
import statistics
import sys

out = sys.argv[1]
runs = collections.defaultdict(list)
split = collections.defaultdict(float)
for path in sorted(glob.glob(f"{out}/run-*.json")):
    build, seed = path.rsplit("/", 1)[1][4:-5].split("-")
    row = json.load(open(path))["rows"][0]
    ttft = sorted(t["ttft_s"] for t in row["turns"] if t.get("ttft_s") is not None)
    p90 = ttft[int(0.9 * (len(ttft) - 1))]
    errors = []
    for d in row["decisions"]:
        s = d.get("served")
        if not s or s.get("predicted_cached_tokens") is None or not s["prompt_tokens"]:
            continue
        predicted, served = s["predicted_cached_tokens"], s["cached_tokens"]
        e = abs(predicted - served) / s["prompt_tokens"]
        errors.append(e)
        way = "under" if predicted < served else "over" if predicted > served else "exact"
        split[(build, d["session"], way)] += e
    runs[build].append(
        (int(seed), row["turns_per_min"], p90, row["wall_s"], row["cached_later"], 100 * sum(errors) / len(errors))
    )
    split[(build, "answers")] += len(errors)
for build, rows in sorted(runs.items()):
    rows.sort()
    for r in rows:
        print(f"{build} seed {r[0]}: {r[1]:.1f} turns/min, TTFT p90 {r[2]:.2f} s, wall {r[3]:.1f} s, cached {r[4]:.3f}, prediction error {r[5]:.1f}%")
    means = [statistics.mean(r[i] for r in rows) for i in range(1, 6)]
    print(f"{build} mean: {means[0]:.1f} turns/min, TTFT p90 {means[1]:.3f} s, wall {means[2]:.1f} s, cached {means[3]:.3f}, prediction error {means[4]:.2f}%")
    answers = split[(build, "answers")]
    for (b, session, way), e in sorted((k, v) for k, v in split.items() if len(k) == 3):
        if b == build and way != "exact" and e > 0:
            print(f"  {session:5} {way:5} {100 * e / answers:.2f} points of the mean error")
