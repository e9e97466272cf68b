#!/usr/bin/env bash
# The 10M-sample planning benchmark: generate a 10M-row manifest, time one pass
# of Python's csv module over it (the baseline: it only splits the rows) and
# `ditscale plan --policy balanced --json --quiet` for 16 ranks (parse + shapes + M_comp search +
# plan + simulate), alternately, RUNS times each (whole process wall and CPU, peak RSS via
# /usr/bin/time -v, the 1-minute load average after each run), and write the table to
# bench/results/plan-10m_cpu_<YYYY-MM>.md: the median of each, and the speed-up as the ratio of
# the medians (and its range over the run pairs). The file's previous results are kept below
# "## History".
#
#   bench/balance/plan_10m.sh [ROWS]    (default 10000000)
# Environment:
#   DITSCALE  binary (default build/tools/ditscale)
#   FORM      short (default: 6 columns path,text,num_frames,height,width,fps with a short caption,
#             ~540 MB; tools/gen_manifest.py --short) or long (8 columns, quoted captions, 1.28 GB)
#   MANIFEST  default /tmp/ditscale-plan-10m-short.csv (FORM=long: /tmp/ditscale-plan-10m.csv),
#             generated when missing (--seed 1)
#   RUNS      timings of each command (default 3); the speed-up uses their medians
#   COMPARE   1: also time `plan --compare` (the three policies) once
#   OUT       default bench/results/plan-10m_cpu_<YYYY-MM>.md (this month's file)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROWS=${1:-10000000}
DITSCALE=${DITSCALE:-build/tools/ditscale}
FORM=${FORM:-short}
RUNS=${RUNS:-3}
COMPARE=${COMPARE:-0}
case "$FORM" in
  short) GEN_FLAGS=(--short); SUFFIX=-short ;;
  long) GEN_FLAGS=(); SUFFIX= ;;
  *) echo "FORM must be short or long, got '$FORM'" >&2; exit 2 ;;
esac
MANIFEST=${MANIFEST:-/tmp/ditscale-plan-$((ROWS / 1000000))m$SUFFIX.csv}
OUT=${OUT:-bench/results/plan-10m_cpu_$(date +%Y-%m).md}
WORLD=16
MODEL=wan2.1-1.3b
[[ -x "$DITSCALE" ]] || { echo "no ditscale binary at $DITSCALE (set DITSCALE=...)" >&2; exit 1; }
[[ "$RUNS" =~ ^[1-9][0-9]?$ ]] || { echo "RUNS must be in [1, 99], got '$RUNS'" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if [[ ! -s "$MANIFEST" ]]; then
  echo "generating $ROWS rows into $MANIFEST ..." >&2
  python3 tools/gen_manifest.py --rows "$ROWS" --seed 1 "${GEN_FLAGS[@]}" --out "$MANIFEST"
fi

# timed NAME CMD...: runs CMD under /usr/bin/time -v into $TMP/NAME.{out,time}; prints
# "wall cpu rss_mib load1".
timed() {
  local name=$1
  shift
  /usr/bin/time -v "$@" > "$TMP/$name.out" 2> "$TMP/$name.time"
  awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,a,":"); s=0; for(i=1;i<=n;i++) s=s*60+a[i]; w=s}
              /User time|System time/ {c+=$2}
              /Maximum resident set size/ {r=$2/1024}
              END {printf "%.2f %.2f %.0f ", w, c, r}' "$TMP/$name.time"
  cut -d' ' -f1 /proc/loadavg
}

CSV_CMD="import csv,sys; n=sum(1 for _ in csv.reader(open(sys.argv[1], newline=''))); print(n)"
ONE_CMD=("$DITSCALE" plan --manifest "$MANIFEST" --model "$MODEL" --world-size "$WORLD"
         --policy balanced --json --quiet)
: > "$TMP/runs"
for i in $(seq "$RUNS"); do
  echo "run $i/$RUNS: python csv pass ..." >&2
  echo "csv $(timed csv python3 -c "$CSV_CMD" "$MANIFEST")" >> "$TMP/runs"
  echo "run $i/$RUNS: ditscale plan --policy balanced ..." >&2
  echo "one $(timed one "${ONE_CMD[@]}")" >> "$TMP/runs"
  cp "$TMP/one.out" "$TMP/one.json"
done
if [[ "$COMPARE" == 1 ]]; then
  echo "ditscale plan --compare ..." >&2
  COMPARE_CMD=("$DITSCALE" plan --manifest "$MANIFEST" --model "$MODEL" --world-size "$WORLD"
               --compare --json --quiet)
  echo "compare $(timed compare "${COMPARE_CMD[@]}")" >> "$TMP/runs"
fi

python3 - "$TMP/runs" "$TMP/one.json" "$MANIFEST" "$OUT" "$FORM" "${ONE_CMD[*]}" <<'PY'
import datetime, json, os, platform, sys
runs_path, one_path, manifest, out, form, cmd = sys.argv[1:]
runs = {}
for line in open(runs_path):
    name, wall, cpu, rss, load = line.split()
    runs.setdefault(name, []).append((float(wall), float(cpu), float(rss), load))
j = json.load(open(one_path))
cpu_name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                 if l.startswith("model name")), "unknown")
size = os.path.getsize(manifest)
form_text = ("6 columns path,text,num_frames,height,width,fps, short unquoted caption; "
             "tools/gen_manifest.py --short --seed 1" if form == "short" else
             "8 columns, quoted captions; tools/gen_manifest.py --seed 1")
def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


med = {k: (median([r[0] for r in v]), median([r[1] for r in v])) for k, v in runs.items()}
pairs = [c[0] / o[0] for c, o in zip(runs["csv"], runs["one"])]
t, c = j["timing_s"], j["timing_cpu_s"]
p = j["policies"]["balanced"]
lines = [
    f"# Planning a 10M-sample manifest for 16 ranks (`ditscale plan --policy balanced`)",
    "",
    f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
    f"- machine: {cpu_name}, {os.cpu_count()} cores visible, {platform.system()} "
    f"{platform.release()}, shared with other jobs (1-minute load average after each run in "
    "the table: wall times include that noise, CPU times (user + sys) less)",
    f"- manifest: {j['rows_total']:,} rows, {size / 1e6:.0f} MB ({form_text}), "
    f"{j['distinct_shapes']} training shapes, model {j['model']}",
    f"- command: `{cmd}`",
    "- baseline: `python3 -c \"import csv; sum(1 for _ in csv.reader(open(F, newline='')))\"`",
    "- script: `bench/balance/plan_10m.sh` (the two commands alternately, "
    f"{len(runs['one'])} runs each)",
    "",
    "| run | command | wall (s) | CPU (s) | peak RSS (MiB) | load |",
    "|---:|---|---:|---:|---:|---:|",
]
label = {"csv": "Python csv module, one pass", "one": "ditscale plan --policy balanced",
         "compare": "ditscale plan --compare"}
for name in ("csv", "one", "compare"):
    for i, (w, cp, r, load) in enumerate(runs.get(name, [])):
        lines.append(f"| {i + 1} | {label[name]} | {w:.2f} | {cp:.2f} | {r:.0f} | {load} |")
lines += [
    "",
    f"Speed-up of `plan --policy balanced` over the csv pass (medians of {len(runs['one'])} "
    f"runs each): **{med['csv'][0] / med['one'][0]:.1f}x wall** (run pairs "
    f"{min(pairs):.1f}x-{max(pairs):.1f}x), {med['csv'][1] / med['one'][1]:.1f}x CPU; peak RSS "
    f"{max(r[2] for r in runs['one']):.0f} MiB. Target: >= 5x wall, <= 1024 MiB.",
    "",
    "Steps of the last `--policy balanced` run (from its --json timing):",
    "",
    "| step | wall (s) | CPU (s) |",
    "|---|---:|---:|",
    f"| read CSV + map rows to shapes (two threads, fused) | {t['parse']:.2f} | "
    f"{c['parse']:.2f} |",
    f"| M_comp search | {t['m_comp_search']:.2f} | |",
    f"| plan balanced (+ simulate) | {p['plan_time_s']:.2f} (+ {p['simulate_time_s']:.2f}) | "
    f"{p['plan_cpu_s']:.2f} (main thread) |",
    f"| whole process (in-process timer) | {t['total']:.2f} | {c['total']:.2f} |",
    "",
    f"balanced: {p['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, compute CV "
    f"{100 * p['compute_cv']:.2f}%, bubble {100 * p['bubble_fraction']:.2f}%, "
    f"{p['num_steps']} steps, {p['dropped_samples']} dropped.",
]
history = []
if os.path.exists(out):
    old = open(out).read().splitlines()
    cut = next((i for i, l in enumerate(old) if l.strip() == "## History"), len(old))
    current, earlier = old[:cut], old[cut + 1:]
    if current:
        current[0] = "###" + current[0].lstrip("#") if current[0].startswith("#") else current[0]
    history = current + earlier
text = "\n".join(lines) + "\n"
if history:
    text += "\n## History\n\n" + "\n".join(l for l in history).strip("\n") + "\n"
open(out, "w").write(text)
print("\n".join(lines))
PY
