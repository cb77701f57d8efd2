#!/usr/bin/env bash
# The stickiness probe of docs/benchmarks.md ("Real peers, side by side"):
# two stub engines that answer at once (stub.py, each naming itself in
# x-engine-id), one peer router in front of them, six conversations of
# eight growing turns with distinct prompts, sent one conversation at a
# time and six at once (probe.py). Prints each conversation's engine per
# turn. Usage: run.sh smg|vllm-router (run from the repository root after
# scripts/setup-peers). Loopback, ephemeral ports; stops what it started.
set -euo pipefail
peer="${1:?smg or vllm-router}"
here="$(dirname "$0")"
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for i in 0 1; do
  python3 "$here/stub.py" 0 "engine-$i" >"$work/e$i.port" 2>/dev/null &
  pids+=($!)
done
until [ -s "$work/e0.port" ] && [ -s "$work/e1.port" ]; do sleep 0.1; done
port=$(free_port); metrics=$(free_port)
launch=(); [ "$peer" = smg ] && launch=(launch)
".hearth/peers/$peer" "${launch[@]}" --host 127.0.0.1 --port "$port" \
  --prometheus-host 127.0.0.1 --prometheus-port "$metrics" --policy cache_aware \
  --worker-urls "http://127.0.0.1:$(cat "$work/e0.port")" "http://127.0.0.1:$(cat "$work/e1.port")" \
  >"$work/router.log" 2>&1 &
pids+=($!)
sleep 8
python3 "$here/probe.py" "$port" none seq
python3 "$here/probe.py" "$port" none par
