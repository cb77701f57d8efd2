#!/usr/bin/env python3
"""Hearth and its peer seed by seed from the runs in DIR (seedN.json beside
least_request, PEER-seedN.json beside PEER), with the gateway CPU, which
ran first, the mean TTFT from inference-perf's own reports, and the means;
prints summary.txt."""
import json, pathlib, re, sys

d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
by_peer = {}
for p in sorted(d.glob("*seed*.json")):
    m = re.fullmatch(r"(?:(.+)-)?seed(\d+)", p.stem)
    run = json.load(open(p))
    rows = {r["policy"]: r for r in run["rows"]}
    for report in run["reports"]:
        ttft = report["summary"]["successes"]["latency"]["time_to_first_token"]
        rows[report["policy"]]["ttft_mean_s"] = ttft["mean"]
    by_peer.setdefault(m.group(1) or "least_request", {})[int(m.group(2))] = rows
for peer, rows in by_peer.items():
    seeds = sorted(rows)
    print(f"Hearth beside {peer}\n")
    print(f"| seed | first | req/s Hearth / {peer} | TTFT mean s | TTFT p50 s | TTFT p90 s | TTFT p99 s | failed | gateway CPU s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in seeds:
        h, o = rows[s]["hearth"], rows[s][peer]
        first = "hearth" if s % 2 else peer
        cell = lambda k, f="{:.2f}": f"{f.format(h[k])} / {f.format(o[k])}"
        print(f"| {s} | {first} | {cell('requests_per_s')} | {cell('ttft_mean_s')} | {cell('ttft_p50_s')} | {cell('ttft_p90_s')} | "
              f"{cell('ttft_p99_s')} | {h['failed']} / {o['failed']} | {cell('gateway_cpu_s', '{:.1f}')} |")
    mean = lambda p, k: sum(rows[s][p][k] for s in seeds) / len(seeds)
    print()
    for k, lower in (("requests_per_s", False), ("ttft_mean_s", True), ("ttft_p50_s", True), ("ttft_p90_s", True), ("ttft_p99_s", True)):
        wins = sum((rows[s]["hearth"][k] < rows[s][peer][k]) == lower for s in seeds)
        print(f"{k}: means Hearth {mean('hearth', k):.3f}, {peer} {mean(peer, k):.3f} "
              f"(Hearth / {peer} {mean('hearth', k) / mean(peer, k):.3f}); Hearth better on {wins} of {len(seeds)} seeds")
    print()
