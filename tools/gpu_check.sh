#!/usr/bin/env bash
# One command for a lent GPU machine: builds ditscale with CUDA + Torch, runs every GPU test and
# benchmark, writes logs under $OUT (or ./gpu-out), and prints a short table last.
#   tools/gpu_check.sh [all|adaln|sp]      (default: all)
# Each step runs under `timeout` so a hang costs seconds, not the whole lease.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
declare -a ROWS
row() { ROWS+=("$(printf '| %-34s | %-6s | %s |' "$1" "$2" "$3")"); }
step() {  # step NAME TIMEOUT_S CMD...  -> logs to $OUT/NAME.log, records pass/fail
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  echo "== $name: $*"
  timeout --signal=TERM --kill-after=10 "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 ))
  tail -n 25 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then row "$name" ok "${dt}s"; else row "$name" "FAIL" "rc=$rc ${dt}s (see $name.log)"; fi
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
JOBS=$(nproc)
step configure 300 cmake -S . -B build-gpu -G Ninja -DDITSCALE_CUDA=ON -DDITSCALE_TORCH=OFF \
     -DDITSCALE_CUDA_ARCHS=90a -DPython3_EXECUTABLE="$(command -v $PY)"
step build 600 cmake --build build-gpu -j"$JOBS"
step ctest-cpu 300 ctest --test-dir build-gpu -LE gpu --output-on-failure -j"$JOBS"
step ctest-gpu 300 ctest --test-dir build-gpu -L gpu --output-on-failure
step pip-install 600 env CMAKE_ARGS="-DDITSCALE_CUDA_ARCHS=90a" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
     $PY -m pip install --no-build-isolation --no-deps -q .

if [ "$WHAT" = all ] || [ "$WHAT" = adaln ]; then
  step pytest-adaln-gpu 600 $PY -m pytest -q -x tests/gpu/test_adaln_cuda.py
  if command -v compute-sanitizer >/dev/null; then
    step sanitizer-adaln 600 compute-sanitizer --tool memcheck --error-exitcode 1 \
         build-gpu/tests/gpu/adaln_gpu_test --gtest_filter='*PlainPerSample*:*Strided*'
  fi
  step bench-adaln 600 $PY bench/adaln/bench_adaln.py --warm-cache 18 --out "$OUT/adaln-h200.md"
  [ -x build-gpu/bench/adaln_kernel_bench ] && step bench-adaln-kernel 300 build-gpu/bench/adaln_kernel_bench
fi

echo
echo "== summary ($(head -2 "$OUT/gpu.txt" | tail -1))"
printf '| %-34s | %-6s | %s |\n' step result detail
printf '|%s|%s|%s|\n' "------------------------------------" "--------" "-----------------"
for r in "${ROWS[@]}"; do echo "$r"; done
[ -f "$OUT/adaln-h200.md" ] && tail -n 30 "$OUT/adaln-h200.md"
