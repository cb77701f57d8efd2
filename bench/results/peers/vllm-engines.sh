# Sourced by the result scripts that start their own vLLM replicas:
#   start_engines LOG [ARGS...]  runs `target/release/hearth-bench vllm ARGS`
#                                in its own process group, its output in LOG,
#                                and sets ENGINES (A,B) once they answer;
#   stop_engines                 ends that process group.
# Run from the project's root.
engines_pid=
start_engines() {
  local log=$1; shift
  setsid target/release/hearth-bench vllm "$@" > "$log" 2>&1 &
  engines_pid=$!
  ENGINES=
  for _ in $(seq 600); do
    ENGINES=$(tail -1 "$log" | grep -E '^127\.0\.0\.1:[0-9]+,127\.0\.0\.1:[0-9]+$' || true)
    [ -n "$ENGINES" ] && return 0
    kill -0 "$engines_pid" 2>/dev/null || { cat "$log"; return 1; }
    sleep 1
  done
  echo "engines not up after 600 s" >&2
  return 1
}
stop_engines() {
  [ -n "$engines_pid" ] && kill -- "-$engines_pid" 2>/dev/null
  engines_pid=
}
