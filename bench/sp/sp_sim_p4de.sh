#!/usr/bin/env bash
# Simulated reproduction of SwiftFusion's evaluation setting (AWS p4de.24xlarge: 8x A100 per
# machine, NVSwitch inside, 4x100 Gb/s EFA between; 2 and 4 machines; Flux 3072^2 / 4096^2 and
# CogVideoX-5B 20 s / 40 s), with the ditscale planner/simulator (ditscale sp plan).
#
# For every setting it ranks usp, swiftfusion-tas and torus (all degrees, torus chunks 1/2/4/8,
# two- and one-sided) and compares:
#   USP   the best usp configuration on two-sided transport (what yunchang/xDiT run: NCCL),
#   TAS   the best swiftfusion-tas configuration on two-sided transport (the paper's ablation),
#   Full  the best torus configuration on one-sided transport (SwiftFusion: Torus + NVSHMEM).
# Writes bench/results/sp-simulated-p4de_cpu_<YYYY-MM>.md (or $1) with per-layer and per-step
# (whole model) speed-ups next to the paper's reported figures.
#
# Usage: bench/sp/sp_sim_p4de.sh [OUT.md]      (env: BUILD=build dir with the ditscale binary,
#                                            CLUSTER=p4de or a JSON file)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
CLUSTER=${CLUSTER:-p4de}
OUT=${1:-bench/results/sp-simulated-p4de_cpu_$(date +%Y-%m).md}
BIN="$BUILD/tools/ditscale"
if [[ ! -x "$BIN" ]]; then
  cmake -S . -B "$BUILD" -G Ninja -DDITSCALE_TORCH=OFF -DDITSCALE_CUDA=OFF >/dev/null
  cmake --build "$BUILD" -j2 --target ditscale >/dev/null
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Sensitivity variants of the cluster (same settings, summary rows only).
echo '{"base": "p4de", "name": "p4de-efa-half", "nic_bandwidth_GBps": 21.25}' >"$TMP/efa-half.json"
echo '{"base": "p4de", "name": "p4de-nccl-heavy", "two_sided_sync_us": 100,
       "two_sided_sm_fraction": 0.3}' >"$TMP/nccl-heavy.json"
echo '{"base": "p4de", "name": "p4de-efa-half-nccl-heavy", "nic_bandwidth_GBps": 21.25,
       "two_sided_sync_us": 100, "two_sided_sm_fraction": 0.3}' >"$TMP/both.json"

run() {  # tagdir cluster name machines model args...
  local dir=$1 cluster=$2 name=$3 machines=$4 model=$5
  shift 5
  mkdir -p "$TMP/$dir"
  "$BIN" sp plan --cluster "$cluster" --machines "$machines" --model "$model" "$@" \
    --strategies usp,swiftfusion-tas,torus --top 0 --json >"$TMP/$dir/$name.m$machines.json"
}
for variant in main:"$CLUSTER" efa-half:"$TMP/efa-half.json" nccl-heavy:"$TMP/nccl-heavy.json" \
               both:"$TMP/both.json"; do
  dir=${variant%%:*}
  cl=${variant#*:}
  for m in 2 4; do
    run "$dir" "$cl" flux-3072 "$m" flux --height 3072 --width 3072
    run "$dir" "$cl" flux-4096 "$m" flux --height 4096 --width 4096
    run "$dir" "$cl" cogvideox-20s "$m" cogvideox-5b --duration-s 20
    run "$dir" "$cl" cogvideox-40s "$m" cogvideox-5b --duration-s 40
  done
done

mkdir -p "$TMP/notes"
cat >"$TMP/notes/notes.md" <<'MD'

## Assumptions of the simulator (see ditscale/sp/topology.h and simulator.h)

- p4de preset: NVSwitch 240 GB/s per GPU per direction (achieved all-to-all busbw of 300 GB/s
  NVLink3), EFA 4x100 Gb/s = 42.5 GB/s achieved per machine per direction, shared by the 8 GPUs
  of the machine (max-min fair sharing among concurrent flows), latency 5 us / 20 us; attention
  200 TFLOP/s asymptotic (flash-attention 2 on A100) times Eff(q)*Eff(kv), Eff(t) = t/(t+128);
  linear layers 250 TFLOP/s; HBM 1.6 TB/s for merges and packs; 5 us per kernel launch.
- Two-sided (NCCL) transfers: rendezvous of both sides, 15 us of sync per message, and NCCL
  kernels take 10% of the SMs of both endpoints while they run. One-sided (NVSHMEM) puts: 2 us,
  no SMs, no rendezvous.
- Whole step = layers x (attention layer + linear FLOPs / N / linear throughput); norms, VAE, text
  encoder and the CFG batch are not modelled, so the per-step speed-up is a diluted version of the
  per-layer one (linear work is identical for all strategies).
- The schedules are exactly the ones the CPU reference executor checks against dense attention;
  the simulator runs them under the same execution model (three in-order streams per rank,
  groups, deps, rendezvous, counters).

## Where the simulation disagrees with the paper, and why

1. **2 machines: USP wins in the simulation; the paper reports TAS 1.27x faster.** At M = 2 the
   two placements move exactly the same bytes across machines per rank (usp U=8 R=2:
   2*(S/2)*(H/8)*d*e; tas U=2 R=8: 4*(S/16)*H*d*e*(1/2); both S*H*d*e/8, asserted in
   planner_test `InterMachineVolumeOfUspAndTas`). USP's cross-machine traffic is a ring step that
   the simulator overlaps almost perfectly with the first ring step's attention (~96% hidden),
   while TAS's cross-machine traffic is an all-to-all that blocks attention. The volume argument
   of the paper only starts at M >= 3 (at M = 4, usp sends 2x more bytes per rank than tas, and
   TAS does win in the simulation for Flux). So the paper's measured 2-machine gain must come from
   effects that this model does not have: NCCL ring send/recv over EFA overlapping badly with
   compute in practice (proxy threads, rail-local NICs, small per-step messages), and USP's
   per-step rendezvous and kernel launches on the critical path. The sensitivity table shows the
   direction: halving the effective EFA bandwidth and making NCCL heavier moves both TAS and
   Full up, but not to the paper's 1.27x / 1.35x; we cannot reproduce the 2-machine TAS gain
   from bandwidth and volume alone.
2. **Torus is now a fully pipelined schedule, and Full matches the paper's average (1.31x vs
   1.35x) and passes its best case (1.88x vs 1.77x).** An earlier version of the torus schedule
   gave Full 0.94x average / 1.12x best: only the stationary block and the first ring step could
   be attended while the cross-machine all-to-all was in flight (later ring steps forwarded the
   neighbour's whole gathered kv block, which waited for every chunk), and the out all-to-all
   back was not pipelined (outputs only became final after the last ring step). The schedule now
   (ditscale/sp/strategies/torus.cc): (a) keeps all R kv blocks of the ring resident (kall/vall,
   S*H/U*d*e*2 bytes per rank instead of two blocks; no ring flow control needed) and forwards
   every kv piece around the ring on its own (stationary slot at once, then each torus chunk as
   soon as it arrived: R-1 hops per piece); (b) attends "arrived queries x newly arrived kv" and
   "newly arrived queries x kv so far", each (q, kv) pair exactly once with LSE merges, grouping
   kv ranges to >= 4096 tokens per kernel; (c) sends k, v one chunk ahead of q (kv0, kv1, q0, kv2,
   q1, ...): with U = 4, "all kv first" starves compute while kv is in flight (4x8 Flux 4096^2:
   12.6 ms) and "q, k, v together" makes every query final only at the end (12.1 ms), kv-ahead
   gives 11.3 ms (same build, two-sided); (d) finishes query chunks one by one at the end and
   issues each chunk's out all-to-all back as soon as it is final, the stationary queries (whose
   out stays local) last, so that their compute covers the last chunk's way back. Torus still
   moves exactly the bytes and FLOPs of TAS (schedule_test `VolumesMatchClosedForms`) and the
   reference executor checks it against dense attention over every mesh/chunk/transport/text
   case. With it, Full hides 79-100% of its communication (was 38-89%).
3. **Where it still disagrees.** (i) 2 machines: Full is 1.01-1.24x over USP, the most where
   USP leaves communication exposed (Flux 3072^2: USP hides 69%). Where USP already hides
   >= 96% (Flux 4096^2, CogVideoX 40 s) both are compute-bound, and the simulator's kernel
   efficiency Eff(q)*Eff(kv), Eff(t) = t/(t+128), favours USP's two 32k-token blocks (3 heads)
   over torus's shorter ones (4k-16k tokens, 6-12 heads) plus their LSE merges (~0.5 ms per
   layer). A real flash-attention kernel sees similar tile counts (tokens x heads) in both, so
   this part of the model is pessimistic for torus; we leave the model as it is.
   (ii) 4 machines: Full 1.19-1.88x, above the paper's best for Flux 3072^2. The model is
   optimistic for any pipelined schedule: perfect max-min fair NIC sharing, no interference
   between NVSHMEM traffic and attention kernels (one-sided puts take no SMs), no HBM contention
   from the ring copies, and the extra memory of resident kv blocks is free.
   (iii) TAS alone (two-sided, unchunked) is unchanged at 0.89x average, for the reasons of
   point 1. (iv) One-sided vs two-sided: the
   one-sided "ready" and "done" rounds used to send their ~24 cross-machine signals one after
   another on the inter-machine stream (~0.5 ms per round, since the text all-gather makes every
   rank a writer to every other); they are now issued as one group, as a real NVSHMEM loop of
   non-blocking signals would be. The model charges NCCL only 15 us per message and 10% of the
   SMs, so one-sided gains only a few percent over two-sided torus here (4-6% on Flux 4096^2);
   the `nccl-heavy` variant shows the sensitivity.
4. **The paper's two averages are not from the same set**: TAS alone 1.27x (2+ machines) and
   Torus + one-sided "a further 1.35x" would compound to ~1.7x, but the overall average is
   reported as 1.35x (max 1.77x). We compare against each as stated.
MD
NOTES_DIR="$TMP/notes" python3 - "$TMP" "$OUT" "$CLUSTER" <<'PY'
import json, os, sys
root, out, cluster = sys.argv[1], sys.argv[2], sys.argv[3]
tmp = os.path.join(root, "main")
settings = [("flux-3072", "Flux 3072x3072"), ("flux-4096", "Flux 4096x4096"),
            ("cogvideox-20s", "CogVideoX-5B 20 s"), ("cogvideox-40s", "CogVideoX-5B 40 s")]

def best(cands, strategy, one_sided):
    c = [x for x in cands if x["strategy"] == strategy and x["one_sided"] == one_sided]
    return min(c, key=lambda x: x["predicted_layer_s"]) if c else None

def short(c):
    s = f"U={c['ulysses_degree']} R={c['ring_degree']}"
    if c["strategy"] == "torus":
        s += f" c={c['torus_chunks']}"
    return s

rows, tas_l, full_l, tas_s, full_s = [], [], [], [], []
for m in (2, 4):
    for key, label in settings:
        j = json.load(open(os.path.join(tmp, f"{key}.m{m}.json")))
        cands = j["candidates"]
        usp, tas, full = best(cands, "usp", False), best(cands, "swiftfusion-tas", False), \
            best(cands, "torus", True)
        w = j["workload"]
        lt = usp["predicted_layer_s"] / tas["predicted_layer_s"]
        lf = usp["predicted_layer_s"] / full["predicted_layer_s"]
        st = usp["predicted_step_s"] / tas["predicted_step_s"]
        sf = usp["predicted_step_s"] / full["predicted_step_s"]
        tas_l.append(lt); full_l.append(lf); tas_s.append(st); full_s.append(sf)
        rows.append(
            f"| {m}x8 | {label} | {w['tokens']}+{w['text_tokens']} | "
            f"{short(usp)}: {usp['predicted_layer_s']*1e3:.1f} ms, {usp['predicted_step_s']:.2f} s | "
            f"{short(tas)}: {tas['predicted_layer_s']*1e3:.1f} ms, {tas['predicted_step_s']:.2f} s | "
            f"{short(full)}: {full['predicted_layer_s']*1e3:.1f} ms, {full['predicted_step_s']:.2f} s | "
            f"{lt:.2f}x / {st:.2f}x | {lf:.2f}x / {sf:.2f}x | "
            f"{usp['max_inter_bytes_per_rank']/1e6:.0f} / {tas['max_inter_bytes_per_rank']/1e6:.0f} MB | "
            f"{100*usp['hidden_comm_fraction']:.0f}% / {100*full['hidden_comm_fraction']:.0f}% |")
avg = lambda v: sum(v) / len(v)
with open(out, "w") as f:
    f.write(f"""# SwiftFusion on p4de, simulated

Generated by `bench/sp/sp_sim_p4de.sh` (cluster preset `{cluster}`) with the ditscale
discrete-event simulator (`ditscale/sp/simulator.h`) over the schedules the CPU reference executor
verifies against dense attention (`ditscale/sp/strategies.h`). No GPU was used: these are
predictions from the constants in `ditscale/sp/topology.h`, not measurements.

Columns: **USP** = best `usp` (Ulysses within machines, Ring across) on two-sided (NCCL-style)
transport over all degrees; **TAS** = best `swiftfusion-tas` (Ulysses across machines, Ring within)
on two-sided transport; **Full** = best `torus` (TAS with the cross-machine all-to-all chunked and
pipelined, chunks 1/2/4/8) on one-sided (NVSHMEM-style) transport. Each cell: degrees, attention
layer time, whole step (one forward pass of all layers, linear layers split over the ranks).
Speed-ups are over USP, per attention layer / per step. "inter MB" is the busiest rank's bytes
sent to other machines per layer (USP / TAS); "hidden" the share of communication time that
overlaps compute (USP / Full).

| machines | workload | tokens | USP | TAS | Full | TAS speed-up (layer / step) | Full speed-up (layer / step) | inter MB (USP / TAS) | hidden (USP / Full) |
|---|---|---|---|---|---|---|---|---|---|
""")
    f.write("\n".join(rows) + "\n\n")
    f.write(f"""## Summary against the paper

| | paper (measured, p4de, end to end) | simulated, attention layer | simulated, whole step |
|---|---|---|---|
| TAS over USP, average (2+ machines) | 1.27x | {avg(tas_l):.2f}x | {avg(tas_s):.2f}x |
| Full SwiftFusion over USP, average | 1.35x | {avg(full_l):.2f}x | {avg(full_s):.2f}x |
| Full SwiftFusion over USP, best case | 1.77x | {max(full_l):.2f}x | {max(full_s):.2f}x |
| Full over TAS, average | 1.35x (as summarised) | {avg([a/b for a,b in zip(full_l,tas_l)]):.2f}x | {avg([a/b for a,b in zip(full_s,tas_s)]):.2f}x |
""")
    f.write("""
## Sensitivity: which unmodelled effect would close the gap

Average / best speed-up over USP per attention layer, for the same settings on variants of the
preset (`nic` = EFA bandwidth per machine; `nccl-heavy` = two-sided sync 100 us per message and
NCCL kernels taking 30% of the SMs while they run, instead of 15 us and 10%):

| cluster variant | TAS avg | Full avg | Full best |
|---|---|---|---|
""")
    for d, label in (("main", f"{cluster} as preset"), ("efa-half", "nic 21.25 GB/s"),
                     ("nccl-heavy", "nccl-heavy"), ("both", "nic 21.25 GB/s + nccl-heavy")):
        tl, fl = [], []
        for m in (2, 4):
            for key, _ in settings:
                c = json.load(open(os.path.join(root, d, f"{key}.m{m}.json")))["candidates"]
                usp = best(c, "usp", False)["predicted_layer_s"]
                tl.append(usp / best(c, "swiftfusion-tas", False)["predicted_layer_s"])
                fl.append(usp / best(c, "torus", True)["predicted_layer_s"])
        f.write(f"| {label} | {avg(tl):.2f}x | {avg(fl):.2f}x | {max(fl):.2f}x |\n")
    f.write(open(os.path.join(os.environ["NOTES_DIR"], "notes.md")).read())
print(open(out).read())
PY
