# Sourced by the lease scripts (tools/gpu_check.sh, tools/gpu_train.sh, tools/gpu_bench.sh): each
# step of a lease runs under `timeout` with its output in a log file, and becomes a row of the
# table printed last.
#
#   STEP_LOG_DIR=DIR        where NAME.log goes (set before calling step)
#   STEP_TAIL=N             lines of the log printed after a step (default 20)
#   step NAME TIMEOUT_S CMD...   runs CMD, logs to $STEP_LOG_DIR/NAME.log, prints its tail,
#                                adds the row "NAME ok Ns" or "NAME FAIL rc=R Ns (NAME.log)",
#                                returns CMD's status (124 on timeout)
#   row NAME RESULT DETAIL       adds a row of one's own
#   print_rows                   the table: a header and every row, in order
declare -a ROWS
row() { ROWS+=("$(printf '| %-30s | %-6s | %s |' "$1" "$2" "$3")"); }
step() {
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  echo "== $name: $*"
  timeout --signal=TERM --kill-after=15 "$t" "$@" >"$STEP_LOG_DIR/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 ))
  tail -n "${STEP_TAIL:-20}" "$STEP_LOG_DIR/$name.log"
  if [ $rc -eq 0 ]; then row "$name" ok "${dt}s"; else row "$name" FAIL "rc=$rc ${dt}s ($name.log)"; fi
  return $rc
}
print_rows() {
  printf '| %-30s | %-6s | %s |\n' step result detail
  printf '|%s|%s|%s|\n' "--------------------------------" "--------" "------------------"
  local r
  for r in "${ROWS[@]}"; do echo "$r"; done
}
