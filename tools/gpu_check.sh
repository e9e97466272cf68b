#!/usr/bin/env bash
# One command for a lent GPU machine: builds ditscale with CUDA + Torch, runs every GPU test and
# benchmark, writes logs under $OUT (or ./gpu-out), and prints a short table last.
#   tools/gpu_check.sh [all|adaln|sp|diffusers]      (default: all)
# Each step runs under `timeout` so a hang costs seconds, not the whole lease.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# step NAME TIMEOUT_S CMD... -> $OUT/NAME.log and a row of the table (tools/steps.sh)
source tools/steps.sh
STEP_LOG_DIR=$OUT STEP_TAIL=25

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
JOBS=$(nproc)
# BUILD_DIR: the CMake build (default build-gpu; a path outside a carried snapshot survives
# between the calls of a warm lease). PIP_BUILD_DIR: scikit-build-core's build dir for
# `pip install .` (default build-py/<tag> of pyproject.toml), same reason.
BUILD=${BUILD_DIR:-build-gpu}
PIP_ARGS=()
[ -n "${PIP_BUILD_DIR:-}" ] && PIP_ARGS=(-C "build-dir=$PIP_BUILD_DIR")
# BUILD_MODE: full (CMake build with CUDA, CPU + GPU ctest, pip install), py (pip install and
# the CPU-only `ditscale` CLI: enough for the sp stage), none (a warm machine that already
# built; SKIP_BUILD=1 is the old spelling).
MODE=${BUILD_MODE:-full}
[ "${SKIP_BUILD:-0}" = 1 ] && MODE=none
pip_install() {
  step pip-install 600 env CMAKE_ARGS="-DDITSCALE_CUDA_ARCHS=90a" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
       $PY -m pip install --no-build-isolation --no-deps -q "${PIP_ARGS[@]}" .
}
case $MODE in
full)
  step configure 300 cmake -S . -B "$BUILD" -G Ninja -DDITSCALE_CUDA=ON -DDITSCALE_TORCH=OFF -DDITSCALE_BUILD_LAB=ON \
       -DDITSCALE_CUDA_ARCHS=90a -DPython3_EXECUTABLE="$(command -v $PY)"
  step build 600 cmake --build "$BUILD" -j"$JOBS"
  [ "${SKIP_CPU_TESTS:-0}" = 1 ] || step ctest-cpu 300 ctest --test-dir "$BUILD" -LE gpu --output-on-failure -j"$JOBS"
  [ "${SKIP_GPU_TESTS:-0}" = 1 ] || step ctest-gpu 300 ctest --test-dir "$BUILD" -L gpu --output-on-failure
  pip_install;;
py)  # the CLI builds on the CPU side of the machine while pip compiles the extension
  ( cmake -S . -B "$BUILD" -G Ninja -DDITSCALE_CUDA=OFF -DDITSCALE_TORCH=OFF \
      -DDITSCALE_BUILD_TESTS=OFF -DDITSCALE_BUILD_BENCHMARKS=OFF >"$OUT/cli-build.log" 2>&1 \
    && cmake --build "$BUILD" -j"$JOBS" --target ditscale >>"$OUT/cli-build.log" 2>&1 ) &
  CLI_PID=$!
  pip_install
  if wait $CLI_PID; then row cli-build ok "$BUILD/tools/ditscale"; else row cli-build FAIL "see cli-build.log"; fi;;
none) ;;
*) echo "BUILD_MODE=$MODE: expected full, py or none" >&2; exit 2;;
esac

if [ "$WHAT" = all ] || [ "$WHAT" = adaln ]; then
  step pytest-adaln-gpu 600 $PY -m pytest -q -x tests/gpu/test_adaln_cuda.py
  if command -v compute-sanitizer >/dev/null; then
    step sanitizer-adaln 600 compute-sanitizer --tool memcheck --error-exitcode 1 \
         "$BUILD"/tests/gpu/adaln_gpu_test --gtest_filter='*PlainPerSample*:*Strided*'
  fi
  step bench-adaln 600 $PY -m bench.adaln.bench_adaln --warm-cache 18 --out "$OUT/adaln.md"
  step profile-adaln 300 $PY -m bench.adaln.profile_adaln --out "$OUT/adaln-profile.md"
  [ -x "$BUILD"/bench/adaln_kernel_bench ] && step bench-adaln-kernel 300 "$BUILD"/bench/adaln_kernel_bench
fi

if [ "$WHAT" = all ] || [ "$WHAT" = sp ]; then
  # SwiftFusion attention benchmark (after the sp GPU tests): calibrate the simulator on this
  # machine, time every strategy and the peers on NVLink and on 2 emulated machines, then the
  # report (bench/sp/*.py). One torchrun launch per link type: NCCL_HOSTID is read at NCCL init.
  SPD="$OUT/sp"
  mkdir -p "$SPD"
  NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
  # All GPUs of the host (on 4 GPUs the emulated run is 2 machines x 2 GPUs,
  # the central SwiftFusion setting). An even count is needed for 2 emulated machines.
  NP=${SP_NPROC:-$NGPU}
  TRUN="$PY -m torch.distributed.run --standalone --nproc-per-node $NP"
  CLI=$BUILD/tools/ditscale
  # SP_PARTS picks the parts (two calls of one lease: "test calib bench-nvlink", then
  # SKIP_BUILD=1 SP_PARTS="bench-emulated report example"); "diag", "channels", "sockets" and
  # "sanitize" are opt-in. "replay", "split" and "overlap" need one GPU only: every strategy's
  # compute on one rank with the transfers skipped, what cutting one attention call costs, and
  # which transfers run beside one (lab/results/sp-overlap_h200_2026-12/).
  PARTS=" ${SP_PARTS:-test replay overlap calib bench-nvlink bench-emulated report example} "
  has() { case "$PARTS" in *" $1 "*) return 0;; esac; return 1; }
  if [ "$NGPU" -ge 1 ]; then
    has test && step sp-replay-test 300 $PY -m pytest -q tests/gpu/test_sp_gpu.py -k replay
    # Every one-sided strategy through the copy-engine engine, all ranks in this process.
    has test && step sp-local-check 600 env CUDA_DEVICE_MAX_CONNECTIONS=32 \
         $PY tests/gpu/sp_local_check.py ${SP_LOCAL_ARGS:-}
    has test && step sp-local-check-signal-copy 300 env CUDA_DEVICE_MAX_CONNECTIONS=32 \
         DITSCALE_SP_CE_SIGNAL=copy $PY tests/gpu/sp_local_check.py --quick
    # The same with every rank's compute stream in an SM partition (a CUDA green context).
    has test && step sp-local-check-partition 300 env CUDA_DEVICE_MAX_CONNECTIONS=32 \
         $PY tests/gpu/sp_local_check.py --quick --comm-sms 4
    # memcheck of the copy-engine engine and of compute streams on SM partitions (opt-in).
    if has sanitize && command -v compute-sanitizer >/dev/null; then
      step sp-local-sanitizer 300 env CUDA_DEVICE_MAX_CONNECTIONS=32 compute-sanitizer \
           --tool memcheck --report-api-errors no --error-exitcode 1 \
           $PY tests/gpu/sp_local_check.py --tiny --comm-sms 4
    fi
    has replay && step sp-replay 300 $PY -m bench.sp.replay_compute --out "$SPD/replay"
    has split && step sp-split 300 $PY -m lab.probes.attn_split_probe --out "$SPD/split"
    # What runs beside a cuDNN attention call (it holds every SM): SM kernels, copy engines,
    # NCCL, and (the C++ probe) NVSHMEM on-stream puts / signals / waits and stream memory ops.
    if has overlap; then
      step sp-overlap 120 $PY -m lab.probes.attn_overlap_probe --out "$SPD/overlap"
      step sp-pack-copy 120 $PY -m lab.probes.pack_copy_probe --out "$SPD/overlap"
      # The attention call on an SM partition, and what runs beside it on the SMs left over.
      step sp-sm-partition 120 $PY -m lab.probes.sm_partition_probe --out "$SPD/overlap"
      [ -x "$BUILD"/lab/sp_overlap_probe ] && step sp-overlap-primitives 120 \
           "$BUILD"/lab/sp_overlap_probe --json "$SPD/overlap/primitives.json"
    fi
  fi
  if [ "$NGPU" -ge 2 ]; then
    if has test; then
      step sp-check-nvlink 300 $TRUN tests/gpu/sp_attention_check.py
      # Gradients of every strategy's backward on CUDA (torch_backward.py) against dense autograd.
      step sp-grad-check 300 $TRUN tests/gpu/sp_grad_check.py
      # The one-sided cases above ran on the default engine (copy engines on one host); these on
      # NVSHMEM's on-stream kernels.
      step sp-check-nvlink-nvshmem-engine 240 env DITSCALE_SP_ONE_SIDED_ENGINE=nvshmem \
           $TRUN tests/gpu/sp_attention_check.py --quick
      # The copy-engine engine's signals as 8-byte copies (if a stream write to a peer's memory
      # fails above, this is the form to use: DITSCALE_SP_CE_SIGNAL=copy).
      step sp-check-nvlink-signal-copy 240 env DITSCALE_SP_CE_SIGNAL=copy \
           $TRUN tests/gpu/sp_attention_check.py --quick
      step sp-check-emulated 240 $TRUN tests/gpu/sp_attention_check.py --emulate-machines 2 --quick
      # Compute streams in an SM partition (4 SMs kept for NCCL's kernels and the packs).
      step sp-check-emulated-partition 240 env DITSCALE_SP_COMM_SMS=4 \
           $TRUN tests/gpu/sp_attention_check.py --emulate-machines 2 --quick
    fi
    # memcheck of the sp path. API errors are not reported: NCCL's communicator init probes
    # kernels built for other architectures (cudaFuncGetAttributes -> "no kernel image", handled
    # inside libnccl; 16 such reports on the H200 and nothing else).
    if has sanitize && command -v compute-sanitizer >/dev/null; then
      step sp-sanitizer 240 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
           --no-python compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
           $PY tests/gpu/sp_attention_check.py --tiny
    fi
    if has calib; then
      step sp-calibrate-nvlink 150 $TRUN -m bench.sp.calibrate measure \
           --out "$SPD/calib-raw-nvlink.json"
      step sp-calibrate-emulated 150 $TRUN -m bench.sp.calibrate measure --emulate-machines 2 \
           --p2p-only --out "$SPD/calib-raw-emulated.json"
      step sp-calibrate-fit 60 $PY -m bench.sp.calibrate fit "$SPD"/calib-raw-*.json \
           --out-dir "$SPD/calib" --ditscale "$CLI"
    fi
    has bench-nvlink && step sp-bench-nvlink 300 $TRUN -m bench.sp.bench_sp_attention \
         --seq 36864 65536 --text 512 --meshes auto 2x$((NP / 2)) --time-budget-s ${SP_BENCH_S:-150} \
         --json "$SPD/sp-nvlink.json"
    # The one-sided strategies again on NVSHMEM's on-stream kernels (the default above is the
    # copy-engine engine): the A/B of the engines, kept out of the report's sp-*.json.
    has bench-nvlink && step sp-bench-nvlink-kernels 240 env DITSCALE_SP_ONE_SIDED_ENGINE=nvshmem \
         $TRUN -m bench.sp.bench_sp_attention --seq 36864 65536 --text 512 --transports nvshmem \
         --strategies ulysses ulysses-overlap ring torus --chunks 2 --peers --check-seq 0 \
         --time-budget-s ${SP_BENCH_KERNELS_S:-120} --json "$SPD/engine-nvshmem-kernels.json"
    has bench-emulated && step sp-bench-emulated 300 $TRUN -m bench.sp.bench_sp_attention \
         --seq 36864 65536 --text 512 --emulate-machines 2 --time-budget-s ${SP_BENCH_S:-150} \
         --json "$SPD/sp-emulated.json"
    # The overlapped strategies again with their compute streams in an SM partition (NCCL's
    # socket kernels then run beside the attention calls): rows "... comm_sms=4" of the report.
    has bench-emulated && step sp-bench-emulated-partition 240 $TRUN \
         -m bench.sp.bench_sp_attention --seq 36864 65536 --text 512 --emulate-machines 2 \
         --strategies ring ulysses-overlap torus --chunks 2 4 --comm-sms 4 --peers --check-seq 0 \
         --time-budget-s ${SP_BENCH_PART_S:-120} --json "$SPD/sp-emulated-partition.json"
    # diag (opt-in): where the time of Ulysses and Ring goes, NCCL vs NVSHMEM: kernel table
    # (torch.profiler) and every rank's per-unit GPU timeline (ditscale.sp.timeline).
    has diag && step sp-diag 200 $TRUN -m bench.sp.bench_sp_attention --seq 36864 --text 512 \
         --strategies ulysses ulysses-overlap ring --transports nccl nvshmem --peers plain-ulysses --check-seq 0 \
         --warmup 2 --iters 3 --repeats 1 --profile --timeline --json "$SPD/diag.json"
    # channels (opt-in): the emulated-machine run of the hybrids with more NCCL channels (sockets)
    # per peer on ditscale's inter-machine communicator; compare with sp-emulated.json.
    has channels && step sp-bench-channels 300 $TRUN -m bench.sp.bench_sp_attention \
         --seq 36864 65536 --text 512 --emulate-machines 2 --strategies usp swiftfusion-tas torus \
         --transports nccl --peers --net-channels-per-peer ${SP_NET_CHANNELS:-8} \
         --time-budget-s ${SP_BENCH_S:-150} --json "$SPD/channels.json"
    # sockets (opt-in): the emulated-machine run, peers included, with more socket threads per
    # NCCL connection (the loopback link is CPU-bound per socket); compare with sp-emulated.json.
    has sockets && step sp-bench-sockets 300 env NCCL_SOCKET_NTHREADS=${SP_SOCKET_NTHREADS:-4} \
         NCCL_NSOCKS_PERTHREAD=${SP_NSOCKS_PERTHREAD:-2} $TRUN -m bench.sp.bench_sp_attention \
         --seq ${SP_SOCKET_SEQ:-65536} --text 512 --emulate-machines 2 \
         --strategies ring usp torus --transports nccl --time-budget-s ${SP_BENCH_S:-150} \
         --json "$SPD/sockets.json"
    # The simulator's compute rate anchored to each launch's one-GPU run and the emulated link
    # fitted to its runs (with each S held out): calib/fit-runs.json, a section of the report.
    FR=$(ls "$SPD"/sp-nvlink.json "$SPD"/sp-emulated.json 2>/dev/null || true)
    has report && [ -n "$FR" ] && step sp-fit-runs 240 $PY -m bench.sp.fit_runs $FR \
         --calib-dir "$SPD/calib" --ditscale "$CLI"
    has report && step sp-report 120 $PY -m bench.sp.report "$SPD"/sp-*.json \
         --calib-dir "$SPD/calib" --ditscale "$CLI" --out "$OUT/sp-x$NP.md" \
         --summary "$OUT/sp-summary.txt"
    has example && step sp-inference 420 $TRUN examples/sp_inference.py --resolution 3072 4096 \
         --strategies ${SP_EXAMPLE_STRATEGIES:-all} --steps-timed 2 --json "$SPD/sp-inference.json"
  else
    row sp-bench skip "needs 2 GPUs, found $NGPU"
  fi
fi

if [ "$WHAT" = all ] || [ "$WHAT" = diffusers ]; then
  # The diffusers integration on one GPU (needs diffusers; it travels as a wheel: .whl/).
  # DF_PARTS picks the parts: test (tests/gpu/test_diffusers_gpu.py), adaln (stock vs
  # apply_fused_adaln, fwd+bwd, eager and compiled), sp (parallelize at world size 1 vs stock).
  DPARTS=" ${DF_PARTS:-test adaln sp} "
  dhas() { case "$DPARTS" in *" $1 "*) return 0;; esac; return 1; }
  dhas test && step diffusers-gpu-test 600 env CUDA_DEVICE_MAX_CONNECTIONS=32 $PY -m pytest -q tests/gpu/test_diffusers_gpu.py
  dhas adaln && step diffusers-adaln 600 $PY -m bench.diffusers.adaln_models \
       --models ${DF_ADALN_MODELS:-wan2.1-1.3b,wan2.1-14b,flux} --out-dir "$OUT/diffusers"
  dhas sp && step diffusers-sp-overhead 600 $PY -m bench.diffusers.sp_overhead \
       --models ${DF_SP_MODELS:-flux,wan2.1-1.3b,hunyuan-video,cogvideox-5b,sd3.5-medium} \
       --out-dir "$OUT/diffusers"
fi

echo
echo "== summary ($(head -2 "$OUT/gpu.txt" | tail -1))"
print_rows
[ -f "$OUT/adaln.md" ] && tail -n 30 "$OUT/adaln.md"
for f in "$OUT"/diffusers/adaln-models.md "$OUT"/diffusers/sp-overhead.md; do
  [ -f "$f" ] && { echo; echo "== $(basename "$f")"; cat "$f"; }
done
if [ -f "$OUT/sp-summary.txt" ]; then
  echo; echo "== sp attention (ms per layer; details in $OUT/sp-x<GPUs>.md)"; cat "$OUT/sp-summary.txt"
fi
