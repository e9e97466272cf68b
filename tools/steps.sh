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
#   wheels_and_build             the `wheels` and `build` parts of a lease script that defines
#                                `has PART` and PY: every .whl/*.whl into /tmp/site (then first
#                                on PYTHONPATH), and tools/gpu_check.sh's build (BUILD_MODE,
#                                default py; its logs in $STEP_LOG_DIR/build)
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
wheels_and_build() {
  has wheels && step wheels 120 $PY -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  has build && step build 400 env BUILD_MODE=${BUILD_MODE:-py} OUT="$STEP_LOG_DIR/build" \
    bash tools/gpu_check.sh build
  return 0
}
