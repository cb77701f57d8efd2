#!/usr/bin/env python3
"""Per cell and policy: requests/s, TTFT p50 / p90 / p99 and failures of
run.sh's runs (inference-perf's own report, as `hearth-bench compare`
tabled it), and what failed, by inference-perf's label."""
import glob, json, os

here = os.path.dirname(os.path.abspath(__file__))
for cell in ("low", "saturating"):
    print(f"## {cell}")
    print("| seed | policy | req/s | TTFT p50 / p90 / p99 s | cached | failed |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    failed = []
    for path in sorted(glob.glob(os.path.join(here, f"{cell}-seed*.json"))):
        seed = path.rsplit("seed", 1)[1][:-5]
        d = json.load(open(path))
        for r in d["rows"]:
            print(
                f"| {seed} | {r['policy']} | {r['requests_per_s']:.2f} "
                f"| {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} / {r['ttft_p99_s']:.2f} "
                f"| {100 * r['cached_share']:.1f}% | {r['failed']} |"
            )
        for rep in d.get("reports", []):
            failures = rep.get("summary", {}).get("failures", {})
            for label, f in (failures.get("by_label") or {}).items():
                messages = "; ".join(m["message"] for m in f.get("messages", []))
                failed.append(f"- seed {seed}, {rep['policy']}: {f['count']} x {label}: {messages}")
    print()
    print("\n".join(failed or ["- no request failed"]))
    print()
