#!/usr/bin/env python3
"""Every inference-perf report kept under bench/results whose output tokens a
second were counted by re-tokenizing the answers' text (the harness's default
until compare set `use_server_output_tokens`), where that count strays from
the engine's own (each answer's usage): the report, the policy, the harness's
figure, the figure from the engine's count, their ratio, and the share of
answers counted at about the longest length (as if every other answer
counted what the engine did).
Usage: bench/results/peers/output-tokens/summary.py [ROOT]   (ROOT: bench/results)
"""
import glob
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
checked = 0
rows = []
for path in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        continue
    if not isinstance(doc, dict) or doc.get("driver") != "inference-perf":
        continue
    for report in doc.get("reports", []):
        ok = report["summary"].get("successes", {})
        text = ok.get("output_len") or {}
        engine = ok.get("output_tokens") or {}
        rate = (ok.get("throughput") or {}).get("output_tokens_per_sec")
        if not text or not engine or not rate or not ok.get("count"):
            continue
        checked += 1
        counted = text["mean"] * ok["count"]
        if counted <= 0 or abs(counted - engine["total"]) / counted < 0.10:
            continue
        engine_rate = rate * engine["total"] / counted
        # The share of answers counted at about the longest length, if
        # every other answer counted what the engine did.
        engine_mean = engine["total"] / ok["count"]
        share = (text["mean"] - engine_mean) / (text["max"] - engine_mean)
        rows.append((os.path.relpath(path, root), report["policy"], rate, engine_rate,
                     rate / engine_rate, text["max"], engine["max"], share))

print(f"# {checked} policy runs in inference-perf reports under {root}; "
      f"{len(rows)} whose re-tokenized output count strays 10% or more from the engine's")
print("| report | policy | out tok/s (re-tokenized) | out tok/s (engine's count) | ratio | longest answer re-tokenized / engine's | answers counted that long (about) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} | {r[5]:.0f} / {r[6]:.0f} | "
          f"{100 * r[7]:.1f}% |")
