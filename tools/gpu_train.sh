#!/usr/bin/env bash
# AdaptiveLoad end to end on the local GPUs:
#   build -> shape sweep (FSDP2) -> ditscale fit -> train with equal-token / adaptive / balanced
#   (+ balanced without the fused AdaLN) -> fused-AdaLN memory sweep -> summary markdown + PNG.
#
#   tools/gpu_train.sh [STAGE...]     stages: build sweep fit train adaln report | all (default)
#
# Stages keep their outputs in $WORK (default build-train/run, git-ignored, survives between
# calls on a warm machine) and every call copies logs and results to $OUT (or ./gpu-out).
# Within the 10-minute command limit, run it in parts, e.g.
#   tools/gpu_train.sh build                  (pip install with the CUDA ops + the CLI)
#   tools/gpu_train.sh sweep fit              (~4-5 min: 180 s sweep budget + start-up)
#   tools/gpu_train.sh train report           (~6 min: 4 runs x 60 s + start-up)
#   tools/gpu_train.sh adaln report           (~2 min)
# Results: $OUT/train-x<NPROC>.md (commit it as bench/results/train_<gpu>x<NPROC>_<YYYY-MM>.md,
# indexed in docs/results.md) and $OUT/train-x<NPROC>-loss.png, plus bench.csv, cost.json,
# fit.json, train-*.jsonl, logs.
# MODEL_IMPL=diffusers: the sweep, the training runs and the adaln stage use diffusers'
# WanTransformer3DModel of the same dimensions (--model-impl diffusers; fused = its
# apply_fused_adaln), its work dir is build-train/run-diffusers (its own sweep and cost) and its
# results train-diffusers-x<NPROC>.md / -loss.png.
# Knobs (environment):
#   MODEL (wan2.1-1.3b)  LAYERS (8)  MAX_FRAMES (81: Wan's clip length, 720p up to 75600 tokens)
#   MODEL_IMPL (ditscale: ditscale's WanDiT | diffusers: diffusers' WanTransformer3DModel)
#   MANIFEST (examples/manifests/mixed_2k.csv)  M_MEM (auto: min(fit M_mem, 160000))
#   TRAIN_RUNS (equal-token adaptive balanced balanced-nofused: the runs of the train stage)
#   TRAIN_BUDGET_S (60 per run)  TRAIN_STEPS (400, a cap)  SWEEP_BUDGET_S (180)
#   SWEEP_MAX_TOKENS (160000: B*S cap of the sweep)  NPROC (all GPUs)  SEED (0)
#   MEM_BUDGET_GIB (40: memory budget of the longest-sequence estimate)
#   SHAPE_MODEL_JSON (a ditscale JSON model file instead of MODEL + MAX_FRAMES)
#   DITSCALE_CLI (path of the ditscale binary)  ADALN_SHAPES (FxHxW list of the adaln stage)
# Every step runs under `timeout`; process groups time out after 60 s; a failed step is a FAIL
# row in the table printed last and the next steps still run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
MODEL_IMPL=${MODEL_IMPL:-ditscale}
case $MODEL_IMPL in
  ditscale) RUN_DIR=run; REPORT_PREFIX=train;;
  diffusers) RUN_DIR=run-diffusers; REPORT_PREFIX=train-diffusers;;
  *) echo "MODEL_IMPL must be ditscale or diffusers, got '$MODEL_IMPL'" >&2; exit 2;;
esac
IMPL=(--model-impl "$MODEL_IMPL")
WORK=${WORK:-$ROOT/build-train/$RUN_DIR}
mkdir -p "$OUT" "$WORK"
STAGES=${*:-all}
[ "$STAGES" = all ] && STAGES="build sweep fit train adaln report"
PY=${PYTHON:-python3}
# A fresh machine: install first when the package (with its models) is missing.
case " $STAGES " in *" build "*) ;; *)
  $PY -c "import ditscale.models, ditscale.shape_bench" 2>/dev/null || STAGES="build $STAGES";;
esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
MODEL=${MODEL:-wan2.1-1.3b}
LAYERS=${LAYERS:-8}
MAX_FRAMES=${MAX_FRAMES:-81}
MANIFEST=${MANIFEST:-$ROOT/examples/manifests/mixed_2k.csv}
M_MEM=${M_MEM:-auto}
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-60}
TRAIN_STEPS=${TRAIN_STEPS:-400}
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-180}
SEED=${SEED:-0}
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NPROC=${NPROC:-${NGPU:-1}}
[ "$NPROC" -ge 1 ] 2>/dev/null || NPROC=1
case $MODEL in wan2.1-*) SHAPE_BASE=$MODEL;; *) SHAPE_BASE=wan2.1-1.3b;; esac
if [ -n "${SHAPE_MODEL_JSON:-}" ]; then  # a ditscale JSON model file mapping rows to shapes
  SHAPE_MODEL=$SHAPE_MODEL_JSON
else
  SHAPE_MODEL=$WORK/shape-model.json
  echo "{\"base\": \"$SHAPE_BASE\", \"max_frames\": $MAX_FRAMES}" > "$SHAPE_MODEL"
fi

# step NAME TIMEOUT_S CMD... -> $WORK/NAME.log and a row of the table (tools/steps.sh)
source "$ROOT/tools/steps.sh"
STEP_LOG_DIR=$WORK
# The launcher (a command, so that `timeout` can run it): torchrun on NPROC GPUs, python for one.
if [ "$NPROC" -gt 1 ]; then
  LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
else
  LAUNCH=("$PY")
fi
cli() {
  for c in ${DITSCALE_CLI:-} "$ROOT/build-train/cli/tools/ditscale" "$ROOT/build-gpu/tools/ditscale"; do
    [ -x "$c" ] && "$c" fit --help >/dev/null 2>&1 && { echo "$c"; return; }
  done
  command -v ditscale
}
fused_flag() {  # diffusers: also apply_fused_adaln's Wan module
  $PY -c "import ditscale.ops as o, sys; sys.exit(0 if o.is_available() else 1)" 2>/dev/null \
    && { [ "$MODEL_IMPL" != diffusers ] || $PY -c "import ditscale.diffusers.adaln_wan" \
         2>/dev/null; } || echo --no-fused-adaln
}
m_mem() {
  if [ "$M_MEM" != auto ]; then echo "$M_MEM"; return; fi
  $PY - "$WORK/fit.json" <<'EOF'
import json, sys
try:
    m = json.load(open(sys.argv[1])).get("m_mem_tokens")
except Exception:
    m = None
print(min(int(m), 160000) if m and m > 0 else 160000)
EOF
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/gpu.txt" 2>&1
cat "$WORK/gpu.txt"
GPU_NAME=$(sed -n 2p "$WORK/gpu.txt" | cut -d, -f1)

for S in $STAGES; do
  case $S in
  build)
    step pip-install 900 env CMAKE_ARGS="-DDITSCALE_CUDA_ARCHS=90a" \
         CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $PY -m pip install --no-build-isolation --no-deps -q .
    step import-check 120 $PY -c "import ditscale, ditscale.models, ditscale.shape_bench, \
ditscale.ops as o; print('fused adaln available:', o.is_available(), o.load_error())"
    if [ "$MODEL_IMPL" = diffusers ]; then
      step import-diffusers 120 $PY -c "import diffusers, ditscale.models.diffusers_wan, \
ditscale.diffusers.adaln_wan; print('diffusers', diffusers.__version__)"
    fi
    if [ -z "$(cli)" ]; then
      step cli-build 600 bash -c "cmake -S . -B build-train/cli -G Ninja -DDITSCALE_CUDA=OFF \
        -DDITSCALE_TORCH=OFF -DDITSCALE_BUILD_TESTS=OFF -DDITSCALE_BUILD_BENCHMARKS=OFF \
        && cmake --build build-train/cli -j$(nproc) --target ditscale"
    fi
    ;;
  sweep)
    step sweep $((SWEEP_BUDGET_S + 240)) "${LAUNCH[@]}" -m ditscale.shape_bench --model "$MODEL" \
         --num-layers "$LAYERS" --manifest "$MANIFEST" --shape-model "$SHAPE_MODEL" \
         --max-shapes 8 --max-tokens "${SWEEP_MAX_TOKENS:-160000}" --points-per-shape 3 --warmup 2 --steps 3 \
         --accum-points "${SWEEP_ACCUM_POINTS:-3}" \
         --time-budget-s "$SWEEP_BUDGET_S" --seed "$SEED" $(fused_flag) "${IMPL[@]}" \
         --out "$WORK/bench.csv"
    ;;
  fit)
    C=$(cli)
    if [ -z "$C" ]; then row fit FAIL "no ditscale CLI (run the build stage)"; continue; fi
    step fit 120 bash -c "'$C' fit '$WORK/bench.csv' --gpu-mem-gib 140 --out '$WORK/cost.json' \
      && '$C' fit '$WORK/bench.csv' --gpu-mem-gib 140 --json > '$WORK/fit.json'"
    MM=$(m_mem)
    if ! step plan-compare 120 "$C" plan --manifest "$MANIFEST" --model "$SHAPE_MODEL" \
         --world-size "$NPROC" --cost "$WORK/cost.json" --m-mem "$MM" --compare --seed "$SEED"
    then  # a cost the planner rejects: train with the analytical cost instead
      [ -f "$WORK/cost.json" ] && mv -f "$WORK/cost.json" "$WORK/cost.rejected.json"
      row cost.json moved "planner rejected it: cost.rejected.json, plan-compare.log"
    fi
    ;;
  train)
    MM=$(m_mem)
    COST=()
    [ -f "$WORK/cost.json" ] && COST=(--cost "$WORK/cost.json")
    FF=$(fused_flag)
    for run in ${TRAIN_RUNS:-equal-token adaptive balanced balanced-nofused}; do
      pol=${run%-nofused}
      flag=$FF
      [ "$run" = balanced-nofused ] && flag=--no-fused-adaln
      [ "$run" = balanced-nofused ] && [ -n "$FF" ] && continue  # no fused op: nothing to compare
      step "train-$run" $((TRAIN_BUDGET_S + 240)) "${LAUNCH[@]}" bench/train/policies.py \
           --manifest "$MANIFEST" --model "$MODEL" --num-layers "$LAYERS" \
           --shape-model "$SHAPE_MODEL" --policy "$pol" --steps "$TRAIN_STEPS" \
           --time-budget-s "$TRAIN_BUDGET_S" --m-mem "$MM" "${COST[@]}" $flag --seed "$SEED" \
           "${IMPL[@]}" --log-json "$WORK/train-$run.jsonl"
    done
    ;;
  adaln)  # peak memory and step time at B = 1 with and without the fused AdaLN
    FF=$(fused_flag)
    if [ -n "$FF" ]; then row adaln-memory skip "fused op not available"; continue; fi
    SH=${ADALN_SHAPES:-1x720x1280,17x720x1280,33x720x1280,49x720x1280,65x720x1280,81x720x1280}
    step adaln-mem-fused 420 "${LAUNCH[@]}" -m ditscale.shape_bench --model "$MODEL" \
         --num-layers "$LAYERS" --shapes "$SH" --max-tokens 1 --points-per-shape 1 \
         --warmup 1 --steps 2 --seed "$SEED" "${IMPL[@]}" --out "$WORK/adaln-mem-fused.csv"
    step adaln-mem-eager 420 "${LAUNCH[@]}" -m ditscale.shape_bench --model "$MODEL" \
         --num-layers "$LAYERS" --shapes "$SH" --max-tokens 1 --points-per-shape 1 \
         --warmup 1 --steps 2 --seed "$SEED" --no-fused-adaln "${IMPL[@]}" \
         --out "$WORK/adaln-mem-eager.csv"
    ;;
  report)
    step report 120 $PY - "$WORK" "$OUT" "$NPROC" "$GPU_NAME" "$MODEL" "$LAYERS" "$MANIFEST" \
         "$MAX_FRAMES" "$MODEL_IMPL" "$REPORT_PREFIX" <<'EOF'
import csv, json, os, sys
work, out, nproc, gpu, model, layers, manifest, max_frames, impl, prefix = sys.argv[1:11]
name = f"{prefix}-x{nproc}"
L = []
L.append(f"# AdaptiveLoad training on {nproc}x {gpu}\n")
if impl == "diffusers":
    L.append("Model implementation: diffusers' `WanTransformer3DModel` of the preset's "
             "dimensions (`--model-impl diffusers`; fused AdaLN = "
             "`ditscale.diffusers.apply_fused_adaln`).\n")
L.append(f"Model {model} with {layers} layers (random init, synthetic flow-matching data), "
         f"FSDP2 over {nproc} GPU(s), bf16; manifest `{os.path.relpath(manifest)}` mapped with "
         f"max_frames {max_frames}. Generated by `tools/gpu_train.sh`.\n")
fit = None
if os.path.exists(f"{work}/fit.json"):
    fit = json.load(open(f"{work}/fit.json"))
    ch = fit[fit["chosen"]]
    params = ", ".join(f"{k}={ch[k]:.4g}" for k in ch if k != "quality")
    L.append(f"## Cost model (shape sweep, {fit['rows']} points)\n")
    L.append(f"- chosen: {fit['chosen']} ({params}), R^2 {ch['quality']['r2']:.4f}, "
             f"max |residual| {100 * ch['quality']['max_rel_residual']:.1f}%")
    if fit.get("memory"):
        m = fit["memory"]
        L.append(f"- memory: m0 {m['m0'] / 2**30:.2f} GiB, m1 {m['m1'] / 1024:.1f} KiB/token, "
                 f"R^2 {m['r2']:.4f}; M_mem {fit['m_mem_tokens']} tokens at 140 GiB")
    L.append("")
runs = {}
for run in ["equal-token", "adaptive", "balanced", "balanced-nofused"]:
    p = f"{work}/train-{run}.jsonl"
    if not os.path.exists(p):
        continue
    lines = [json.loads(x) for x in open(p) if x.strip()]
    summ = [x for x in lines if x["type"] == "summary"]
    steps = [x for x in lines if x["type"] == "step"]
    if summ:
        runs[run] = (summ[0], steps)
def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"
if runs:
    base = runs.get("equal-token", (None,))[0]
    L.append("## Policies (same manifest, seed and time budget)\n")
    L.append("| run | steps | tokens/s | /GPU | vs equal-token | compute CV | bubble | "
             "step-time CV | peak GiB | predicted tokens/s | measured/predicted | "
             "predicted CV | loss first -> last |")
    L.append("|" + "---|" * 13)
    for run, (s, _) in runs.items():
        m, p = s["measured"], s.get("predicted", {})
        rel = (f"{m['tokens_per_s'] / base['measured']['tokens_per_s']:.3f}x" if base else "")
        label = run if s["fused_adaln"] or "nofused" in run else f"{run} (eager AdaLN)"
        ptok = f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") else "n/a"
        ratio = p.get("measured_over_predicted_tokens_per_s")
        L.append(f"| {label} | {s['timed_steps']} | "
                 f"{m['tokens_per_s']:,.0f} | {m['tokens_per_s_per_gpu']:,.0f} | {rel} | "
                 f"{pct(m['compute_cv'])} | {pct(m['bubble_fraction'])} | "
                 f"{pct(m['step_time_cv'])} | {m['peak_mem_bytes'] / 2**30:.1f} | {ptok} | "
                 f"{'n/a' if ratio is None else f'{ratio:.3f}'} | "
                 f"{pct(p.get('compute_cv'))} | {s['loss'][0]:.4f} -> {s['loss'][-1]:.4f} |")
    L.append("\ncompute CV: mean over steps of std/mean of per-rank compute time; bubble: time "
             "ranks wait at the gradient-sync barrier / rank time; predicted: the simulator's "
             "formula (a + sum B*Work(S) per rank and step) with the fitted cost, same steps.\n")
    if "balanced" in runs and "balanced-nofused" in runs:
        a, b = runs["balanced"][0]["measured"], runs["balanced-nofused"][0]["measured"]
        L.append(f"Fused AdaLN (balanced): {a['tokens_per_s'] / b['tokens_per_s']:.3f}x "
                 f"tokens/s, peak memory {a['peak_mem_bytes'] / 2**30:.1f} vs "
                 f"{b['peak_mem_bytes'] / 2**30:.1f} GiB.\n")
def read_rows(p):
    if not os.path.exists(p):
        return {}
    rows = [r for r in csv.reader(x for x in open(p) if x.strip() and not x.startswith("#"))]
    h = rows[0]
    return {int(r[h.index("seq_len")]): dict(zip(h, r)) for r in rows[1:]}
fz, ea = read_rows(f"{work}/adaln-mem-fused.csv"), read_rows(f"{work}/adaln-mem-eager.csv")
if fz or ea:
    L.append("## Fused AdaLN: B = 1 step time and peak memory by sequence length\n")
    L.append("| S | step fused (s) | step eager (s) | speed-up | peak fused GiB | peak eager GiB |")
    L.append("|---|---|---|---|---|---|")
    for s in sorted(set(fz) | set(ea)):
        f, e = fz.get(s), ea.get(s)
        ft = float(f["step_time_s"]) if f else None
        et = float(e["step_time_s"]) if e else None
        def mem(r):
            if not r:
                return "OOM"
            return f"{float(r['peak_mem_bytes']) / 2**30:.1f}" if r["peak_mem_bytes"] else "n/a"
        sp = f"{et / ft:.3f}x" if ft and et else ""
        fts, ets = (f"{v:.4f}" if v else "OOM" for v in (ft, et))
        L.append(f"| {s} | {fts} | {ets} | {sp} | {mem(f)} | {mem(e)} |")
    L.append("")
    budget = float(os.environ.get("MEM_BUDGET_GIB", "40")) * 2**30
    for label, rows in (("fused", fz), ("eager", ea)):
        pts = [(s, float(r["peak_mem_bytes"])) for s, r in rows.items() if r["peak_mem_bytes"]]
        if len(pts) < 2:
            continue
        n = len(pts)
        mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
        m1 = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        m0 = my - m1 * mx
        smax = int((budget - m0) / m1) if m1 > 0 else 0
        L.append(f"- {label}: peak = {m0 / 2**30:.2f} GiB + {m1 / 1024:.1f} KiB/token x S "
                 f"(activation memory per token); longest sequence at "
                 f"{budget / 2**30:.0f} GiB: {smax:,} tokens")
    L.append("")
if os.path.exists(f"{work}/plan-compare.log"):
    L.append("## Simulator (`ditscale plan --compare`, fitted cost, whole epoch)\n")
    L.append("```\n" + open(f"{work}/plan-compare.log").read().strip() + "\n```\n")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, (s, steps) in runs.items():
        seen, xs, ys = 0, [], []
        for st in steps:
            seen += st.get("samples", 0)
            xs.append(seen)
            ys.append(st["loss"])
        ema, sm = None, []
        for y in ys:  # exponential moving average (0.9) over steps
            ema = y if ema is None else 0.9 * ema + 0.1 * y
            sm.append(ema)
        line = ax[0].plot(xs, sm, label=f"{run} (EMA 0.9)", lw=1.5)[0]
        ax[0].plot(xs, ys, color=line.get_color(), lw=0.6, alpha=0.3)
        ax[1].plot(range(len(sm)), sm, label=run, lw=1.5, color=line.get_color())
    ax[0].set_xlabel("samples seen"); ax[1].set_xlabel("optimizer step")
    for a in ax:
        a.set_ylabel("flow-matching loss"); a.legend(); a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{out}/{name}-loss.png", dpi=110)
    L.append(f"## Loss curves\n\n![loss]({name}-loss.png)\n")
except Exception as e:  # noqa: BLE001
    L.append(f"(no loss plot: {e})\n")
open(f"{out}/{name}.md", "w").write("\n".join(L) + "\n")
print("\n".join(L))
EOF
    ;;
  *) echo "unknown stage $S"; row "$S" FAIL "unknown stage";;
  esac
done

cp -f "$WORK"/*.log "$WORK"/*.csv "$WORK"/*.json "$WORK"/*.jsonl "$WORK"/gpu.txt "$OUT"/ 2>/dev/null
echo
echo "== summary ($GPU_NAME x$NPROC, work dir $WORK)"
print_rows
for f in "$OUT"/train-x*.md "$OUT"/train-diffusers-x*.md; do
  [ -f "$f" ] && { echo; echo "== $f"; grep '^|' "$f"; }
done
exit 0
