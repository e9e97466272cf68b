#!/usr/bin/env bash
# AdaLN kernels on a lent GPU in one call: the GPU tests, a compute-sanitizer memcheck of the
# pipelined kernels, and the bench/adaln kernel timings; logs under $OUT, a short table last.
# Uses prebuilt binaries under $BIN (default build-kernels, carried from a build of the same tree)
# when they run on this machine, else builds them for sm_90a in build-adaln-gpu.
#   tools/gpu_kernels.sh [FULL_VARIANTS] [QUICK_VARIANTS]
#     FULL_VARIANTS   variants timed on every shape (default pipe,tma; "none" skips)
#     QUICK_VARIANTS  forward only, B = 1, N in {16384, 65536}, D in {1536, 3072, 5120}
#                     (default none)
# Variants: see bench/adaln/adaln_kernel_bench.cu. Environment: SANITIZE=0 skips memcheck,
# RACECHECK=1 adds a racecheck run, MEMCHECK_FILTER picks the memcheck tests, FULL_SHAPES
# (B:N:D,...) replaces the full timings' shapes, GATED_SHAPES adds the gated ops' timings
# (`--gated --variants auto,base` on those shapes), PROBE="ARGS" runs
# $BIN/lab/adaln_probe ARGS last (lab/probes/adaln_probe.cu, an experiment; e.g.
# PROBE="--modes stats,pipe,lib --hints 0"; PROBE=all: defaults).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
FULL=${1:-pipe,tma}
QUICK=${2:-}
BIN=${BIN:-build-kernels}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
TEST=$BIN/tests/gpu/adaln_gpu_test
BENCH=$BIN/bench/adaln_kernel_bench
PROBE_BIN=$BIN/lab/adaln_probe
if ! timeout 30 "$TEST" --gtest_list_tests >/dev/null 2>&1 || ! [ -x "$BENCH" ]; then
  echo "== prebuilt binaries do not run here: building"
  B=build-adaln-gpu
  t0=$(date +%s)
  { timeout 200 cmake -S . -B $B -G Ninja -DDITSCALE_CUDA=ON -DDITSCALE_TORCH=OFF -DDITSCALE_BUILD_LAB=ON \
      -DDITSCALE_CUDA_ARCHS=90a &&
    timeout 420 cmake --build $B -j"$(nproc)" --target adaln_gpu_test adaln_kernel_bench \
      adaln_probe; } \
    >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "built in $(( $(date +%s) - t0 ))s"
  TEST=$B/tests/gpu/adaln_gpu_test
  BENCH=$B/bench/adaln_kernel_bench
  PROBE_BIN=$B/lab/adaln_probe
fi
t0=$(date +%s)
timeout 240 "$TEST" >"$OUT/test.log" 2>&1
echo "== gpu tests rc=$? ($(( $(date +%s) - t0 ))s)"
grep -E "seed|^\[  (PASSED|FAILED|SKIPPED)|Failure|rror" "$OUT/test.log" | head -30
if [ "${SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  t0=$(date +%s)
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 "$TEST" \
    --gtest_filter="${MEMCHECK_FILTER:-*Pipelined*:*Strided*}" >"$OUT/memcheck.log" 2>&1
  echo "== memcheck rc=$? ($(( $(date +%s) - t0 ))s)"
  grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" "$OUT/memcheck.log" | head -5
fi
if [ "${RACECHECK:-0}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  t0=$(date +%s)
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 1 "$TEST" \
    --gtest_filter='*Pipelined*' >"$OUT/racecheck.log" 2>&1
  echo "== racecheck rc=$? ($(( $(date +%s) - t0 ))s)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck.log" | head -5
fi
if [ -n "$QUICK" ]; then
  timeout 150 "$BENCH" --quick --fwd-only --variants "$QUICK" >"$OUT/bench_quick.log" 2>&1
  echo "== bench quick rc=$?"
  cat "$OUT/bench_quick.log"
fi
if [ "$FULL" != none ]; then
  timeout 200 "$BENCH" --variants "$FULL" ${FULL_SHAPES:+--shapes "$FULL_SHAPES"} \
    >"$OUT/bench.log" 2>&1
  echo "== bench rc=$?"
  cat "$OUT/bench.log"
fi
if [ -n "${GATED_SHAPES:-}" ]; then
  timeout 200 "$BENCH" --gated --variants auto,base --shapes "$GATED_SHAPES" \
    >"$OUT/bench_gated.log" 2>&1
  echo "== bench gated rc=$?"
  cat "$OUT/bench_gated.log"
fi
if [ -n "${PROBE:-}" ] && [ -x "$PROBE_BIN" ]; then
  read -r -a probe_args <<<"${PROBE/#all/}"
  timeout 200 "$PROBE_BIN" "${probe_args[@]}" >"$OUT/probe.log" 2>&1
  echo "== probe rc=$?"
  cat "$OUT/probe.log"
fi
