#!/usr/bin/env bash
# The multi-GPU measurements of three features on every GPU of one host, a part each
# (bench/README.md): every step under its own `timeout`, the process groups with a short timeout,
# logs under $LOGS (logs.tar.gz in $OUT), the result tables in $OUT and a short table printed last.
# A lent machine's call lasts at most 10 minutes: run one part (or a few VAE_NS) per call.
#
#   PARTS="wheels build" tools/gpu_multi.sh; PARTS=vae VAE_NS="1 2" tools/gpu_multi.sh; ...
#   DRY_RUN=1 tools/gpu_multi.sh        (CPU: NPROC gloo ranks, tiny cases: the CI check)
#
# PARTS (default "vae sp-grad sp-train degrees"):
#   wheels, build  as tools/gpu_bench.sh (every .whl/*.whl into /tmp/site; tools/gpu_check.sh's
#             build, BUILD_MODE default py: the package and the CPU `ditscale` CLI)
#   vae       bench.diffusers.vae_decode_multi under torchrun at each N of VAE_NS (default 1 2 4 8,
#             those <= the GPU count; VAE_CASES, VAE_ARGS), then bench.diffusers.vae_multi_summary
#             over the vae-decode-multi-N.md files in $OUT (vae-multi-summary.md: speed-up against
#             the stock decode at N = 1; files of several calls: copy them into one folder and run
#             `python -m bench.diffusers.vae_multi_summary --dir DIR` there); then the whole
#             pipeline call, examples/generate.py on all GPUs with --vae-parallel on and off
#             (GEN_ARGS; per-stage seconds in generate-vae-{on,off}.txt)
#   sp-grad   tests/gpu/sp_grad_check.py under torchrun on all GPUs: the gradients of every CUDA
#             path of ditscale.sp.attention against dense autograd (not in DRY_RUN: CUDA only)
#   sp-train  bench.train.sp_step on all GPUs: Wan 2.1 1.3B, 75,600 tokens, every degree, and
#             --longest (SP_STEP_ARGS, e.g. "--degrees 8,4 --longest"; timeout SP_S, default 560;
#             sp-step-N.md, rewritten after each degree: a timeout keeps the degrees done)
#   degrees   bench.train.sp_degrees: the corpus and store (in $WORK, kept between calls on a
#             warm machine: DEG_CORPUS_ARGS), ditscale.train on all GPUs with sp_degrees
#             (DEG_MIXED, default 1,2,4,8 up to N) and with each fixed degree of DEG_FIXED (default
#             2 and N), DEG_STEPS steps (DEG_WARMUP not measured), DEG_M_MEM tokens, more flags in
#             DEG_TRAIN_ARGS; the report against `ditscale plan --compare` (sp-degrees-train-N.md)
# PART_S: the timeout of each step in seconds (default 300); PG_S: the process groups' (120).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/gpu-multi-out}
LOGS=${LOGS:-/tmp/gpu-multi-logs}
WORK=${WORK:-/tmp/gpu-multi-work}
PARTS=${PARTS:-vae sp-grad sp-train degrees}
PART_S=${PART_S:-300}
PG_S=${PG_S:-120}
mkdir -p "$OUT" "$LOGS" "$WORK"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
PY=${PYTHON:-python3}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
source tools/steps.sh
STEP_LOG_DIR=$LOGS STEP_TAIL=${STEP_TAIL:-12}

if [ "${DRY_RUN:-0}" = 1 ]; then  # CPU, gloo: the tiny cases of every part
  N=${NPROC:-2}
  DEV=(--device cpu)
  VAE_CASES=${VAE_CASES:-tiny-wan}
  VAE_ARGS=${VAE_ARGS:---reps 1 --dtype fp32}
  GEN_ARGS=${GEN_ARGS:---device cpu --pipeline wan --size tiny --steps 1}
  SP_STEP_ARGS=${SP_STEP_ARGS:---model tiny --num-layers 2 --frames 5 --height 32 --width 32 \
--text-tokens 8 --reps 2 --longest --frames-step 4 --max-frames 13 --oom-above-tokens 8}
  DEG_CORPUS_ARGS=${DEG_CORPUS_ARGS:---model tiny --scale small --videos-480p 2 --videos-720p 2 \
--images 2 --frames 9 --jobs 1 --device cpu}
  DEG_TRAIN_ARGS=${DEG_TRAIN_ARGS:---model tiny --num-layers 2 --num-workers 0}
  DEG_M_MEM=${DEG_M_MEM:-40} DEG_STEPS=${DEG_STEPS:-4} DEG_WARMUP=${DEG_WARMUP:-1}
else
  N=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  DEV=()
fi
[ "$N" -ge 1 ] || { echo "gpu_multi: no GPU found (DRY_RUN=1 runs on the CPU)" >&2; exit 2; }
TORCHRUN=($PY -m torch.distributed.run --standalone)
echo "$N ranks; $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" \
  > "$LOGS/machine.txt"
git log -1 --format='%h %s' 2>/dev/null | cut -c1-100 >> "$LOGS/machine.txt"

wheels_and_build

if has vae; then
  for n in ${VAE_NS:-1 2 4 8}; do
    [ "$n" -le "$N" ] || continue
    step "vae-decode-$n" "$PART_S" "${TORCHRUN[@]}" --nproc-per-node "$n" \
      -m bench.diffusers.vae_decode_multi --cases "${VAE_CASES:-wan2.1-720p,hunyuan-video}" \
      ${VAE_ARGS:-} --timeout-s "$PG_S" --out-dir "$OUT"
  done
  step vae-summary 60 $PY -m bench.diffusers.vae_multi_summary --dir "$OUT"
  GEN=(${GEN_ARGS:---pipeline wan --size full --steps 2})
  ext=mp4; case " ${GEN[*]} " in *" flux "*|*" sd3 "*) ext=png;; esac
  for v in on off; do
    step "vae-generate-$v" "$PART_S" "${TORCHRUN[@]}" --nproc-per-node "$N" \
      examples/generate.py "${GEN[@]}" --vae-parallel "$v" --out "$LOGS/generate-vae-$v.$ext" \
      && grep -A12 '^stage' "$LOGS/vae-generate-$v.log" > "$OUT/generate-vae-$v.txt"
  done
fi

has sp-grad && [ "${DRY_RUN:-0}" != 1 ] && step sp-grad "$PART_S" "${TORCHRUN[@]}" \
  --nproc-per-node "$N" tests/gpu/sp_grad_check.py

has sp-train && step sp-train "${SP_S:-560}" "${TORCHRUN[@]}" --nproc-per-node "$N" \
  -m bench.train.sp_step ${SP_STEP_ARGS:---reps 3 --longest --longest-budget-s 60 \
  --eff-json bench/results/sp-block-eff_h100_2026-12.json} "${DEV[@]}" \
  --timeout-s "$PG_S" --out-dir "$OUT"

if has degrees; then
  pow2() { local d=1 out=""; while [ $d -le "$N" ]; do out="$out${out:+,}$d"; d=$((d * 2)); done
           echo "$out"; }
  MIXED=${DEG_MIXED:-$(pow2)}
  RUNS=("mixed=$MIXED")
  for d in ${DEG_FIXED:-$( (echo 2; echo "$N") | sort -un)}; do
    [ "$d" -le "$N" ] && RUNS+=("fixed-$d=$d")
  done
  [ -f "$WORK/store/store.json" ] || step degrees-corpus "$PART_S" $PY -m bench.train.sp_degrees \
    corpus --work "$WORK" ${DEG_CORPUS_ARGS:---frames 81}
  for r in "${RUNS[@]}"; do
    rm -rf "$WORK/runs/${r%%=*}"
    step "degrees-${r%%=*}" "$PART_S" "${TORCHRUN[@]}" --nproc-per-node "$N" -m ditscale.train \
      --store "$WORK/store" --out "$WORK/runs/${r%%=*}" --policy balanced --sp-degrees "${r#*=}" \
      --steps "${DEG_STEPS:-12}" --m-mem-tokens "${DEG_M_MEM:-40960}" --pg-timeout-s "$PG_S" \
      --checkpoint-every 0 --resume never --no-tensorboard --no-progress "${DEV[@]}" \
      ${DEG_TRAIN_ARGS:---activation-checkpointing full}
  done
  step degrees-report 120 $PY -m bench.train.sp_degrees report --work "$WORK" --runs "${RUNS[@]}" \
    --world-size "$N" --m-mem "${DEG_M_MEM:-40960}" --warmup-steps "${DEG_WARMUP:-3}" \
    --out-dir "$OUT"
fi

tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
echo
echo "== gpu_multi ($(head -1 "$LOGS/machine.txt"); PARTS=$PARTS)"
print_rows
for f in "$OUT"/vae-multi-summary.md "$OUT"/generate-vae-*.txt "$OUT"/sp-step-*.md \
  "$OUT"/sp-degrees-train-*.md; do
  [ -f "$f" ] || continue
  echo; echo "== $(basename "$f")"
  case $f in *.md) sed -n '/^|/,$p' "$f";; *) cat "$f";; esac  # the tables, not the header
done
exit 0
