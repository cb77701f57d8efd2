#!/usr/bin/env python3
"""Where each shared-prefix group's requests went, in decision order, and
how many took more than 0.8 s from decision to answer, from a sidecar
journal (HEARTH_JOURNAL_FILE): usage groups.py journal.jsonl"""
import collections, json, sys

decided, served = {}, {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("chosen"):
        decided[d["request_id"]] = d
    elif d.get("served"):
        served[d["request_id"]] = d["time_ms"]
groups = collections.defaultdict(list)
for d in sorted(decided.values(), key=lambda d: d["time_ms"]):
    groups[d["first_hash"]].append(d["chosen"].rsplit("-", 1)[-1])
for g, where in groups.items():
    print(f"group {g[:6]}: {''.join(where)}")
slow = sum(1 for r, d in decided.items() if r in served and served[r] - d["time_ms"] > 800)
print(f"{len(decided)} requests, {slow} answered more than 0.8 s after their decision")
