#!/usr/bin/env bash
# ditscale's diffusers integration against diffusers' own context parallelism and xDiT on the
# GPUs of one host (bench/results/diffusers-compare-peers_h200x2_2026-12.md), one launch per link
# type, plus the project's multi-GPU sp tables of the same code (tools/gpu_check.sh sp).
#
#   tools/gpu_compare.sh                       (2 GPUs of one host, carry .whl)
#   NPROC=1 tools/gpu_compare.sh               (one GPU: the dry run of every row that exists at
#                                               world size 1, and the 1-GPU baseline)
#
# PHASES (default "wheels build check compare"; NPROC=1: "wheels build compare"):
#   wheels   .whl/*.whl into /tmp/site (diffusers 0.42.1, importlib_metadata, xfuser 0.7.0,
#            yunchang 0.6.4, distvae 0.1.0; the image has the rest of xfuser's needs)
#   build    ditscale with CUDA + Torch through tools/gpu_check.sh's build (BUILD_MODE, default py)
#   check    tools/gpu_check.sh sp on the installed build (SP_PARTS passed through)
#   compare  bench.diffusers.compare_peers: 1 GPU (the stock baseline and every 1-rank row),
#            then NPROC GPUs over NVLink, then NPROC GPUs as 2 emulated machines (NCCL_HOSTID)
# One call of 10 minutes does not hold every phase: on a warm lease run PHASES="wheels build
# check" first, then PHASES="wheels compare" (the build stays installed while the lease is warm).
#
# compare_peers settings: CASES (default flux-2048,flux-4096,wan-480p,wan-720p), BLOCKS (blocks of
# each kind; default 4, 0 = the published 19 + 38 / 30), STEPS (timed, default 3), WARMUP
# (default 1), COMPARE_TIMEOUT_S (per launch, default 300), COMPARE_ARGS (more options).
# Results: $OUT/cmp/compare-peers-*.json, $OUT/cmp/compare-peers.md (the tables, printed last),
# $OUT/cmp/compare.log; the stock outputs that the later launches compare with stay in
# /tmp/compare-peers (each is up to 19 MB: too big to come back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-compare-out}
NPROC=${NPROC:-2}
if [ "$NPROC" = 1 ]; then PHASES=${PHASES:-wheels build compare}; else
  PHASES=${PHASES:-wheels build check compare}; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CMP_OUT="$OUT/cmp"
SCRATCH=/tmp/compare-peers
mkdir -p "$CMP_OUT" "$SCRATCH"
LOG="$CMP_OUT/compare.log"
has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }
ROWS=()
note() { ROWS+=("$(printf '| %-22s | %-6s | %s |' "$1" "$2" "$3")"); }

if has wheels; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >>"$LOG" 2>&1; then note wheels ok "$(ls .whl | tr '\n' ' ')"
  else note wheels FAIL "see compare.log"; fi
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

if has build; then
  BUILD_MODE=${BUILD_MODE:-py} bash tools/gpu_check.sh build >"$CMP_OUT/build.log" 2>&1
  if $PY -c "import ditscale.diffusers, ditscale.sp" >>"$LOG" 2>&1; then note build ok "ditscale imports"
  else note build FAIL "see build.log"; fi
fi

if has check; then
  BUILD_MODE=none bash tools/gpu_check.sh sp 2>&1 | tee "$CMP_OUT/gpu-check-sp.log" | tail -n 40
  note gpu-check-sp done "its own table above; logs under \$OUT"
fi

compare() {  # compare NAME NP ARGS...: one torchrun launch of compare_peers, logged
  local name=$1 np=$2; shift 2
  local t0=$(date +%s)
  echo "== $name ($np processes)" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=15 "${COMPARE_TIMEOUT_S:-300}" \
    $PY -m torch.distributed.run --standalone --nproc-per-node "$np" \
    -m bench.diffusers.compare_peers --cases "${CASES:-flux-2048,flux-4096,wan-480p,wan-720p}" \
    --blocks "${BLOCKS:-4}" --steps "${STEPS:-3}" --warmup-steps "${WARMUP:-1}" \
    --out-dir "$SCRATCH" ${COMPARE_ARGS:-} "$@" >>"$LOG" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then note "$name" ok "${dt}s"; else note "$name" FAIL "rc=$rc ${dt}s (compare.log)"; fi
}

if has compare; then
  BASE="$SCRATCH/compare-peers-1gpu.json"
  compare compare-1gpu 1 --tag 1gpu
  if [ "$NPROC" -ge 2 ] && [ -f "$BASE" ]; then
    compare compare-nvlink "$NPROC" --tag "${NPROC}gpu-nvlink" --baseline-json "$BASE"
    compare compare-emulated "$NPROC" --tag "${NPROC}gpu-emulated2" --emulate-machines 2 \
      --baseline-json "$BASE"
  elif [ "$NPROC" -ge 2 ]; then
    note compare-nvlink skip "no 1-GPU baseline ($BASE)"
  fi
  cp "$SCRATCH"/compare-peers-*.json "$CMP_OUT"/ 2>/dev/null
  : >"$CMP_OUT/compare-peers.md"
  for f in "$SCRATCH"/compare-peers-1gpu.md "$SCRATCH"/compare-peers-*nvlink.md \
           "$SCRATCH"/compare-peers-*emulated2.md; do
    [ -f "$f" ] && { echo "## $(basename "$f" .md)"; echo; cat "$f"; echo; } >>"$CMP_OUT/compare-peers.md"
  done
fi

echo
echo "== gpu_compare (NPROC=$NPROC, PHASES=$PHASES)"
printf '| %-22s | %-6s | %s |\n' phase result detail
printf '|%s|%s|%s|\n' "------------------------" "--------" "-----------------"
for r in "${ROWS[@]}"; do echo "$r"; done
if [ -s "$CMP_OUT/compare-peers.md" ]; then echo; cat "$CMP_OUT/compare-peers.md"; fi
