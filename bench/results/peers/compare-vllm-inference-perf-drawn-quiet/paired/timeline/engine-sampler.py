#!/usr/bin/env python3
"""Each vLLM engine's running and waiting requests and KV use, read from
its /metrics every half second, one JSON line per look; or, given a
file of such lines, their means per slice of --slice seconds.

  engine-sampler.py A,B OUT.jsonl SECONDS
  engine-sampler.py --summary OUT.jsonl [--slice 10]
"""
import argparse
import json
import re
import time
import urllib.request

NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def look(engine):
    text = urllib.request.urlopen(f"http://{engine}/metrics", timeout=2).read().decode()
    figures = {}
    for name in NAMES:
        m = re.search(r"^vllm:%s\{[^}]*\} ([0-9.e+-]+)" % name, text, re.M)
        figures[name] = float(m.group(1)) if m else None
    return figures


def sample(engines, out, seconds):
    end = time.time() + seconds
    with open(out, "w") as f:
        while time.time() < end:
            started = time.time()
            row = {"t": started}
            for i, engine in enumerate(engines):
                try:
                    for name, value in look(engine).items():
                        row[f"{i}.{name}"] = value
                except OSError as e:
                    row[f"{i}.error"] = str(e)
            f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(max(0.0, 0.5 - (time.time() - started)))


def summary(path, width):
    rows = [json.loads(line) for line in open(path)]
    t0 = rows[0]["t"]
    engines = sorted({k.split(".")[0] for r in rows for k in r if k != "t"})
    print("| s | " + " | ".join(f"engine {e}: running / waiting" for e in engines) + " |")
    print("| --- |" + " ---: |" * len(engines))
    k = 0
    while True:
        part = [r for r in rows if k * width <= r["t"] - t0 < (k + 1) * width]
        if not part:
            break
        cells = []
        for e in engines:
            run = [r.get(f"{e}.num_requests_running") or 0 for r in part]
            wait = [r.get(f"{e}.num_requests_waiting") or 0 for r in part]
            cells.append(f"{sum(run) / len(run):.2f} / {sum(wait) / len(wait):.1f}")
        print(f"| {k * width:.0f}-{(k + 1) * width:.0f} | " + " | ".join(cells) + " |")
        k += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--slice", type=float, default=10.0)
    ap.add_argument("args", nargs="+")
    a = ap.parse_args()
    if a.summary:
        summary(a.args[0], a.slice)
    else:
        engines, out, seconds = a.args
        sample(engines.split(","), out, float(seconds))


if __name__ == "__main__":
    main()
