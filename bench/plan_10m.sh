#!/usr/bin/env bash
# The 10M-sample planning benchmark of issue 2: generate a 10M-row mixed manifest, time one pass of
# Python's csv module over it (the baseline: it only splits the rows), then time
# `ditscale plan --compare --json` (parse + shape + M_comp search + the three policies + their
# simulations) and `ditscale plan --policy balanced --json` for 16 ranks with their peak RSS, and
# write the table to bench/results/plan-10m.md.
#
#   bench/plan_10m.sh [ROWS]            (default 10000000)
# Environment: DITSCALE (binary, default build/tools/ditscale), MANIFEST (default
# /tmp/ditscale-plan-10m.csv, generated when missing), OUT (default bench/results/plan-10m.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${1:-10000000}
DITSCALE=${DITSCALE:-build/tools/ditscale}
MANIFEST=${MANIFEST:-/tmp/ditscale-plan-$((ROWS / 1000000))m.csv}
OUT=${OUT:-bench/results/plan-10m.md}
WORLD=16
MODEL=wan2.1-1.3b
[[ -x "$DITSCALE" ]] || { echo "no ditscale binary at $DITSCALE (set DITSCALE=...)" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if [[ ! -s "$MANIFEST" ]]; then
  echo "generating $ROWS rows into $MANIFEST ..." >&2
  python3 tools/gen_manifest.py --rows "$ROWS" --seed 1 --out "$MANIFEST"
fi
SIZE=$(stat -c %s "$MANIFEST")

echo "python csv pass ..." >&2
CSV_CMD="import csv,sys; n=sum(1 for _ in csv.reader(open(sys.argv[1], newline=''))); print(n)"
/usr/bin/time -v python3 -c "$CSV_CMD" "$MANIFEST" > "$TMP/csv.out" 2> "$TMP/csv.time"
wall() { awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,a,":"); s=0; for(i=1;i<=n;i++) s=s*60+a[i]; print s}' "$1"; }
cpu() { awk -F': ' '/User time|System time/ {s+=$2} END {print s}' "$1"; }
rss() { awk -F': ' '/Maximum resident set size/ {printf "%.0f", $2/1024}' "$1"; }
CSV_S=$(wall "$TMP/csv.time")
CSV_CPU=$(cpu "$TMP/csv.time")

PLAN_CMD=("$DITSCALE" plan --manifest "$MANIFEST" --model "$MODEL" --world-size "$WORLD" --compare
          --json --quiet)
echo "ditscale plan ..." >&2
/usr/bin/time -v "${PLAN_CMD[@]}" > "$TMP/plan.json" 2> "$TMP/plan.time"
PLAN_S=$(wall "$TMP/plan.time")
PLAN_RSS=$(rss "$TMP/plan.time")
PLAN_CPU=$(cpu "$TMP/plan.time")
echo "ditscale plan --policy balanced ..." >&2
ONE_CMD=("$DITSCALE" plan --manifest "$MANIFEST" --model "$MODEL" --world-size "$WORLD"
         --policy balanced --json --quiet)
/usr/bin/time -v "${ONE_CMD[@]}" > "$TMP/one.json" 2> "$TMP/one.time"
ONE_S=$(wall "$TMP/one.time")
ONE_RSS=$(rss "$TMP/one.time")
ONE_CPU=$(cpu "$TMP/one.time")
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$TMP/plan.json" "$CSV_S" "$PLAN_S" "$PLAN_RSS" "$SIZE" "$OUT" "${PLAN_CMD[*]}" \
  "$CSV_CPU" "$PLAN_CPU" "$LOAD" "$ONE_S" "$ONE_CPU" "$ONE_RSS" <<'PY'
import datetime, json, os, platform, subprocess, sys
(plan_path, csv_s, plan_s, rss_mib, size, out, cmd, csv_cpu, plan_cpu, load, one_s, one_cpu,
 one_rss) = sys.argv[1:]
one_s, one_cpu, one_rss = float(one_s), float(one_cpu), float(one_rss)
j = json.load(open(plan_path))
csv_s, plan_s, rss_mib = float(csv_s), float(plan_s), float(rss_mib)
csv_cpu, plan_cpu = float(csv_cpu), float(plan_cpu)
cpu = "unknown"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
ncpu = os.cpu_count()
t = j["timing_s"]
c = j["timing_cpu_s"]
lines = [
    "# Planning a 10M-sample manifest (`ditscale plan --compare`, 16 ranks)",
    "",
    f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
    f"- machine: {cpu}, {ncpu} cores visible, {platform.system()} {platform.release()} "
    f"(shared with other jobs, load average {load} after the run: wall times include that "
    "noise, CPU times (user + sys) much less)",
    f"- manifest: {j['rows_total']:,} rows ({int(size) / 1e9:.2f} GB CSV, tools/gen_manifest.py "
    f"--seed 1), {j['distinct_shapes']} training shapes, model {j['model']}",
    f"- command: `{cmd}`",
    f"- baseline: `python3 -c \"import csv; sum(1 for _ in csv.reader(open(F, newline='')))\"`",
    "",
    "| step | wall (s) | CPU (s) |",
    "|---|---:|---:|",
    f"| Python csv module, one pass (baseline) | {csv_s:.2f} | {csv_cpu:.2f} |",
    f"| ditscale: parse CSV | {t['parse']:.2f} | {c['parse']:.2f} |",
    f"| ditscale: shapes | {t['shape']:.2f} | {c['shape']:.2f} |",
    f"| ditscale: M_comp search | {t['m_comp_search']:.2f} | |",
]
order = [n for n in ("equal-token", "adaptive", "balanced") if n in j["policies"]]
for name in order:
    p = j["policies"][name]
    lines.append(f"| ditscale: plan {name} (+ simulate) | {p['plan_time_s']:.2f} "
                 f"(+ {p['simulate_time_s']:.2f}) | {p['plan_cpu_s']:.2f} |")
lines += [
    f"| ditscale plan --compare, whole process | {plan_s:.2f} | {plan_cpu:.2f} |",
    f"| ditscale plan --policy balanced, whole process | {one_s:.2f} | {one_cpu:.2f} |",
    "",
    "Parse and the --compare policies use two threads (CPU time is the sum over threads).",
    "",
    "| run | speed-up, wall | speed-up, CPU | peak RSS (MiB) |",
    "|---|---:|---:|---:|",
    f"| `plan --policy balanced` | **{csv_s / one_s:.1f}x** | {csv_cpu / one_cpu:.1f}x | "
    f"{one_rss:.0f} |",
    f"| `plan --compare` (3 policies) | **{csv_s / plan_s:.1f}x** | {csv_cpu / plan_cpu:.1f}x | "
    f"{rss_mib:.0f} |",
    "",
    "Targets: >= 5x over the csv pass, <= 1536 MiB peak RSS.",
    "",
    f"M_mem = {j['m_mem_tokens']:,} tokens (analytical memory model, 141 GiB), "
    f"M_comp = {j['m_comp']:.4g} (chosen by simulated epoch time), analytical H200 cost.",
    "",
    "| policy | tokens/s/GPU | compute CV | bubble | epoch (s) | lower bound (s) | steps | dropped |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
]
for name in order:
    p = j["policies"][name]
    lines.append(f"| {name} | {p['tokens_per_s_per_gpu']:.0f} | {100 * p['compute_cv']:.2f}% | "
                 f"{100 * p['bubble_fraction']:.2f}% | {p['epoch_time_s']:.0f} | "
                 f"{p['lower_bound_s']:.0f} | {p['num_steps']} | {p['dropped_samples']} |")
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
