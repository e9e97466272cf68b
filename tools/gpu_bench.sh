#!/usr/bin/env bash
# One GPU's benchmarks and GPU tests of the diffusers integration, the AdaLN kernels and the
# server, a phase each (bench/README.md): every phase under its own `timeout`, logs under $LOGS,
# a short table printed last, and what comes back in $OUT kept to a few files (a lent machine
# returns at most 8): logs.tar.gz and the result tables.
#
#   PHASES="wheels build test sp" tools/gpu_bench.sh        (one GPU; carry .whl)
#
# PHASES (default "wheels build test sp adaln"):
#   wheels    every .whl/*.whl into /tmp/site: diffusers 0.42.1, importlib_metadata and zipp;
#             av (PyAV: the train-real phase's media), py-spy (SERVE_PYSPY) and imageio-ffmpeg
#             (the server's MP4s) where a phase needs them; the image has the rest
#   build     ditscale with CUDA + Torch (tools/gpu_check.sh's build, BUILD_MODE default py)
#   kernels   the AdaLN kernels' own GPU tests: tests/gpu/adaln_gpu_test (CUDA gtest against the
#             CPU reference, every kernel path; that target alone, CMake with CUDA) and
#             tests/gpu/test_adaln_cuda.py (the torch ops against the CPU fp64 ops); between
#             them bench/adaln's kernel timings, plain and --gated (KERNEL_SHAPES B:N:D,...),
#             in adaln-kernels.txt
#   test      tests/gpu/test_diffusers_gpu.py (TEST_FILES: other test files; TEST_ARGS: more pytest
#             arguments, e.g. -k rotary)
#   sp        bench.diffusers.sp_overhead: parallelize at world size 1 vs stock, eager and
#             compiled (SP_MODELS, SP_TOKENS, SP_ARGS)
#   adaln     bench.diffusers.adaln_models: stock vs apply_fused_adaln, fwd+bwd (ADALN_MODELS,
#             ADALN_TOKENS, ADALN_ARGS)
#   sp-grad   bench.sp.grad_share: sp.attention fwd+bwd at degree 1 vs SDPA, and one rank's
#             share of the backward at d = 2, 4, 8 (SP_GRAD_ARGS); sp-grad-share.md in $OUT
#   sp-block  bench.sp.block_share: one Ulysses rank's share of a Wan block's training step at
#             d = 2, 4, 8 alone, eff(d, S) (SP_BLOCK_ARGS; sp-block-share.md, sp-block-eff.json)
#   vae       bench.diffusers.vae_bands: the stock VAE decode vs parallelize_vae at world size 1,
#             and one rank's band at N = 2, 4, 8 alone (VAE_ARGS; vae-bands.md in $OUT)
#   saved     bench.diffusers.saved_tensors: what compiled blocks keep for the backward, stock vs
#             fused, and inductor's fwd-left / peak memory (SAVED_MODELS, SAVED_TOKENS)
#   train     NPROC=1 MODEL_IMPL=diffusers tools/gpu_train.sh sweep fit train report with the
#             runs balanced and balanced-nofused (TRAIN_BUDGET_S, SWEEP_BUDGET_S; TRAIN_STAGES
#             the stages, M_MEM passed through)
#   train-real  bench.train.bench_train: a generated corpus (480p / 720p clips, images) ->
#             ditscale.prepare (clips/s) -> ditscale.train at Wan 2.1 1.3B dimensions from the
#             store vs in-memory latents (tokens/s, peak memory), balanced vs equal-token loss
#             (TRAIN_REAL_ARGS replaces the corpus and run sizes, TRAIN_REAL_FLAGS the
#             ditscale.train flags; TRAIN_REAL_S, default 560); train-real_*.md and the loss PNG
#             in $OUT. Needs the build phase's ditscale: on a lent machine run `build` in an
#             earlier call (the build folder stays), then PHASES="wheels train-real".
#   serve     bench.serve.bench_serve (SERVE_ARGS); SERVE_PYSPY=1: under py-spy (its wheel in
#             .whl/), both processes sampled, and bench.serve.pyspy_compare's table of where
#             the server's pipeline call differs from the direct one (serve-pyspy.md)
#   serve-busy  the same with the server variant bench.serve.busy_worker (SERVE_BUSY_ARGS;
#             serve-busy.md)
#   generate  examples/generate.py on the GPU (flux, small, 4 steps)
# PHASE_S: the timeout of each benchmark phase in seconds (default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-bench-out}
LOGS=${LOGS:-/tmp/gpu-bench-logs}
PHASES=${PHASES:-wheels build test sp adaln}
PHASE_S=${PHASE_S:-300}
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
PY=${PYTHON:-python3}
has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }
# step NAME TIMEOUT_S CMD...: $LOGS/NAME.log and a row of the table (tools/steps.sh)
source tools/steps.sh
STEP_LOG_DIR=$LOGS STEP_TAIL=12

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$LOGS/gpu.txt" 2>&1
git log -1 --format='%h %s' 2>/dev/null | cut -c1-100 >> "$LOGS/gpu.txt"
wheels_and_build
if has kernels; then
  step kernels-build 400 bash -c "cmake -S . -B build-gpu-adaln -G Ninja -DDITSCALE_CUDA=ON \
    -DDITSCALE_TORCH=OFF -DDITSCALE_CUDA_ARCHS=90a -DDITSCALE_BUILD_BENCHMARKS=ON \
    -DPython3_EXECUTABLE=$(command -v $PY) && cmake --build build-gpu-adaln -j$(nproc) \
    --target adaln_gpu_test adaln_kernel_bench" \
    && step kernels-gtest 300 build-gpu-adaln/tests/gpu/adaln_gpu_test \
    && step kernels-bench 200 bash -c "for g in '' --gated; do \
      build-gpu-adaln/bench/adaln_kernel_bench \$g --variants auto,base \
      --shapes ${KERNEL_SHAPES:-1:32760:1536,1:75600:1536,1:32760:5120,1:75600:5120}; done \
      | tee $OUT/adaln-kernels.txt"
  step kernels-pytest 400 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_adaln_cuda.py
fi
has test && step test 300 $PY -m pytest -q -p no:cacheprovider \
  ${TEST_FILES:-tests/gpu/test_diffusers_gpu.py} ${TEST_ARGS:-}
has sp && step sp "$PHASE_S" $PY -m bench.diffusers.sp_overhead \
  --models "${SP_MODELS:-flux,wan2.1-1.3b,hunyuan-video,cogvideox-5b,sd3.5-medium}" \
  --tokens "${SP_TOKENS:-4096}" ${SP_ARGS:---reps 8 --max-s 6} --out-dir "$OUT"
has adaln && step adaln "$PHASE_S" $PY -m bench.diffusers.adaln_models \
  --models "${ADALN_MODELS:-wan2.1-1.3b}" --tokens "${ADALN_TOKENS:-1024,32760}" \
  ${ADALN_ARGS:---reps 10 --max-s 8} --out-dir "$OUT"
has sp-grad && step sp-grad "$PHASE_S" $PY -m bench.sp.grad_share ${SP_GRAD_ARGS:-} \
  --out-dir "$OUT"
has sp-block && step sp-block "$PHASE_S" $PY -m bench.sp.block_share ${SP_BLOCK_ARGS:-} \
  --out-dir "$OUT" --json "$OUT/sp-block-eff.json"
has vae && step vae "$PHASE_S" $PY -m bench.diffusers.vae_bands ${VAE_ARGS:-} --out-dir "$OUT"
has saved && step saved "$PHASE_S" $PY -m bench.diffusers.saved_tensors \
  --models "${SAVED_MODELS:-wan2.1-1.3b}" --tokens "${SAVED_TOKENS:-32760}" --out-dir "$OUT"
has train && step train "${TRAIN_S:-420}" env NPROC=1 MODEL_IMPL=diffusers \
  TRAIN_RUNS="balanced balanced-nofused" TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-45} \
  SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-90} OUT="$LOGS/train" \
  bash tools/gpu_train.sh ${TRAIN_STAGES:-sweep fit train report}
has train-real && step train-real "${TRAIN_REAL_S:-560}" $PY -m bench.train.bench_train \
  --model wan2.1-1.3b --work /tmp/bench-train-real --out-dir "$OUT" \
  ${TRAIN_REAL_ARGS:---videos-480p 96 --videos-720p 32 --images 72 --frames 17 --steps 30 \
  --warmup-steps 5} \
  --train-args "${TRAIN_REAL_FLAGS:---activation-checkpointing full --m-mem-tokens 65536}"
[ -f "$LOGS/train/train-diffusers-x1.md" ] && cp "$LOGS/train/train-diffusers-x1.md" "$OUT/"
SPY=()
[ "${SERVE_PYSPY:-0}" = 1 ] && SPY=(/tmp/site/bin/py-spy record --subprocesses --idle --threads
  --nonblocking -r 200 -f raw -o "$LOGS/serve-pyspy.txt" --)
has serve && step serve "$PHASE_S" "${SPY[@]}" $PY -m bench.serve.bench_serve ${SERVE_ARGS:-} \
  --out-dir "$OUT"
[ -f "$LOGS/serve-pyspy.txt" ] && $PY -m bench.serve.pyspy_compare "$LOGS/serve-pyspy.txt" \
  > "$OUT/serve-pyspy.md" 2>&1
has serve-busy && step serve-busy "$PHASE_S" $PY -m bench.serve.bench_serve \
  --server-module bench.serve.busy_worker ${SERVE_BUSY_ARGS:-} --out-dir "$LOGS/serve-busy"
[ -f "$LOGS/serve-busy/serve.md" ] && cp "$LOGS/serve-busy/serve.md" "$OUT/serve-busy.md"
has generate && step generate 240 $PY examples/generate.py --pipeline flux --size small \
  --steps 4 --out "$LOGS/flux-small.png"

tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
echo
echo "== gpu_bench ($(head -1 "$LOGS/gpu.txt"); PHASES=$PHASES)"
print_rows
for f in "$OUT"/adaln-kernels.txt "$OUT"/sp-overhead.md "$OUT"/sp-grad-share.md "$OUT"/sp-block-share.md "$OUT"/vae-bands.md \
  "$OUT"/adaln-models.md \
  "$OUT"/saved-tensors.md "$OUT"/train-real_*.md "$OUT"/serve*.md; do
  [ -f "$f" ] && { echo; echo "== $(basename "$f")"; cat "$f"; }
done
exit 0
