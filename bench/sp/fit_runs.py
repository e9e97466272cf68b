"""Fits the simulator's compute rate and emulated link to measured strategy runs, and says how
well it then predicts runs it was not fitted on (each sequence length held out in turn).

  python -m bench.sp.fit_runs RESULTS.json [MORE.json ...] --calib-dir DIR [--ditscale CLI]

RESULTS are files of bench_sp_attention.py (one per launch: NVLink, emulated machines); DIR is the
output of `calibrate.py fit`. Writes DIR/fit-runs.json and, when an emulated launch is given,
DIR/topology-h200-emulated-fitted.json. Why and how (the GPU clock anchored to the one-GPU run,
the socket link's bandwidth scale and interference while computing): docs/sp_benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from bench.common import find_cli
from bench.sp import simulator_cli  # (no torch import at module level)

FLUX = {"text": 512, "heads": 24, "head_dim": 128}
F_GRID = [i / 10 for i in range(10)]  # 0 .. 0.9
S_GRID = [0.6 + 0.05 * i for i in range(13)]  # 0.6 .. 1.2
WITHIN = 0.15  # the target: within 15% of every measured configuration


def _log_stats(ratios: Sequence[float]) -> dict:
    if not ratios:
        return {"n": 0}
    logs = [math.log(r) for r in ratios]
    return {"n": len(ratios), "rms_log": math.sqrt(sum(x * x for x in logs) / len(logs)),
            "min": min(ratios), "max": max(ratios),
            "within": sum(1 for r in ratios if abs(r - 1) <= WITHIN)}


class Sim:
    """Simulator predictions of one launch's runs for topology overrides, cached."""

    def __init__(self, cli: str, calib_dir: Path, link: str):
        self.cli, self.link = cli, link
        self.base = json.loads((calib_dir / "topology-h200.json").read_text())
        tm = calib_dir / "topology-h200-nvlink-machines.json"
        self.base_machines = json.loads(tm.read_text()) if tm.exists() else None
        self.tmp = tempfile.TemporaryDirectory(prefix="ditscale-fit-runs-")
        self.cache: dict = {}
        self.files: dict = {}

    def topology(self, mesh: Sequence[int], over: tuple) -> str:
        """A topology file for `mesh` with overrides (attention scale, s, f)."""
        machines_view = self.link == "nvlink" and mesh[0] > 1
        key = (machines_view, over)
        if key not in self.files:
            base = self.base_machines if machines_view else self.base
            if base is None:
                raise FileNotFoundError("topology-h200-nvlink-machines.json missing in the "
                                        "calibration folder (needed for a 2x1 mesh on NVLink)")
            self.files[key] = str(Path(self.tmp.name) / f"t{len(self.files)}.json")
            Path(self.files[key]).write_text(json.dumps(apply(base, *over)))
        return self.files[key]

    def ms(self, run: dict, over: tuple) -> float:
        mesh = run.get("mesh") or [1, 1]
        strategy = run["strategy"]
        if run["impl"] == "single":
            mesh, strategy = [1, 1], "ulysses"
        comm_sms = run.get("comm_sms", 0) if run["impl"] == "ditscale" else 0
        key = (tuple(mesh), strategy, run["seq"], run.get("chunks", 1),
               run.get("transport") or "nccl", over, comm_sms)
        if key not in self.cache:
            r = simulator_cli.simulate(self.cli, self.topology(mesh, over), mesh[0], mesh[1],
                                       strategy, run["seq"], chunks=run.get("chunks", 1),
                                       transport=run.get("transport") or "nccl",
                                       comm_sms=comm_sms)
            self.cache[key] = r["predicted_layer_s"] * 1e3
        return self.cache[key]

    def many(self, runs: Sequence[dict], over: tuple) -> list[float]:
        for r in runs:  # the topology files first, in this thread
            self.topology([1, 1] if r["impl"] == "single" else (r.get("mesh") or [1, 1]), over)
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as ex:
            return list(ex.map(lambda r: self.ms(r, over), runs))


def apply(topo: dict, attention_scale: float, bandwidth_scale: float,
          interference: Optional[float]) -> dict:
    """`topo` with the attention rate, the inter-machine bandwidth scaled and f set."""
    t = dict(topo)
    t["attention_tflops"] = topo["attention_tflops"] * attention_scale
    t["nic_bandwidth_GBps"] = topo["nic_bandwidth_GBps"] * bandwidth_scale
    if topo.get("nic_duplex_GBps"):
        t["nic_duplex_GBps"] = topo["nic_duplex_GBps"] * bandwidth_scale
    if interference is not None:  # None: the topology's own (measured, or the preset's)
        t["inter_compute_interference"] = interference
    return t


def rms_log(meas: Sequence[float], pred: Sequence[float]) -> float:
    return math.sqrt(sum(math.log(m / p) ** 2 for m, p in zip(meas, pred)) / len(meas))


def _grid_search(err, f_grid: Sequence[float]) -> tuple[float, float, float]:
    """(error, s, f) minimising err(s, f): S_GRID x f_grid, then a 9 x 9 grid (9 x 1 when f_grid
    has one value) of a quarter of the coarse steps around the best point."""
    best = min((err(s, f), s, f) for s in S_GRID for f in f_grid)
    _, s0, f0 = best
    fine_f = [f0 + 0.025 * k for k in range(-4, 5)] if len(f_grid) > 1 else [f0]
    fine = [(err(s, f), s, f)
            for s in (s0 + 0.0125 * k for k in range(-4, 5)) if s > 0
            for f in fine_f if 0 <= f < 0.95]
    return min(fine + [best])


def fit_link(sim: Sim, runs: Sequence[dict], anchor: float) -> dict:
    """(s, f) minimising the RMS log error over `runs` (_grid_search), and s alone with f = 0:
    how much the interference term adds."""
    meas = [r["ms"] for r in runs]

    def err(s: float, f: float) -> float:
        return rms_log(meas, sim.many(runs, (anchor, round(s, 4), round(f, 4))))

    e, s, f = _grid_search(err, F_GRID)
    e0, s0, _ = _grid_search(err, [0.0])
    return {"bandwidth_scale": round(s, 4), "interference": round(f, 4), "rms_log": e,
            "bandwidth_only": {"bandwidth_scale": round(s0, 4), "rms_log": e0}}


def launch_runs(doc: dict, source: str):
    """(link, the one-GPU runs, ditscale's runs) of a launch with status ok; ValueError naming
    the field when the document is not a Flux bench_sp_attention.py result."""
    if doc.get("kind") != "ditscale-sp-attention-bench":
        raise ValueError(f"{source}: field 'kind': not a bench_sp_attention.py result")
    shape = doc.get("shape", {})
    if any(shape.get(k) != v for k, v in FLUX.items()):
        raise ValueError(f"{source}: field 'shape' is not the Flux attention layer ({FLUX}); "
                         "the simulator's flux model has only that")
    link = doc.get("link")
    if link not in ("nvlink", "emulated"):
        raise ValueError(f"{source}: field 'link' must be nvlink or emulated, got {link!r}")
    runs = [r for r in doc.get("runs", []) if r.get("status") == "ok" and r.get("ms")]
    single = [r for r in runs if r["impl"] == "single"]
    ours = [r for r in runs if r["impl"] == "ditscale"]
    if not single or not ours:
        raise ValueError(f"{source}: needs a one-GPU run and ditscale runs with status ok")
    return link, single, ours


def fit_link_held_out(sim, multi: list, anchor: float, held: dict, log) -> dict:
    """The link fitted on the multi-machine runs, and again per held-out sequence length (the
    held-out runs' predictions go into ``held``, keyed by id(run))."""
    lf = fit_link(sim, multi, anchor)
    log(f"  link fitted on {len(multi)} runs: bandwidth x {lf['bandwidth_scale']}, "
        f"interference {lf['interference']} (rms log error {lf['rms_log']:.3f})")
    lf["measured_interference"] = sim.base.get("inter_compute_interference")
    lf["held_out"] = {}
    seqs = sorted({r["seq"] for r in multi})
    for seq in seqs if len(seqs) > 1 else []:
        train = [r for r in multi if r["seq"] != seq]
        test = [r for r in multi if r["seq"] == seq]
        h = fit_link(sim, train, anchor)
        lf["held_out"][str(seq)] = h
        log(f"  held out S = {seq}: fitted on the other lengths: bandwidth x "
            f"{h['bandwidth_scale']}, interference {h['interference']}")
        for r, p in zip(test, sim.many(test, (anchor, h["bandwidth_scale"],
                                               h["interference"]))):
            held[id(r)] = p
    return lf


def fit_launch(doc: dict, source: str, cli: str, calib_dir: Path, log=print) -> dict:
    """Anchor, fit and held-out predictions of one bench_sp_attention.py launch."""
    link, single, ours = launch_runs(doc, source)
    sim = Sim(cli, calib_dir, link)
    one = (1.0, 1.0, None)
    # The simulated one-GPU time is attention-bound: scaling the attention rate by a scales it
    # by ~1/a, so a = predicted / measured (geometric mean over the sequence lengths).
    per_seq = {r["seq"]: sim.ms(r, one) / r["ms"] for r in single}
    anchor = round(math.exp(sum(math.log(v) for v in per_seq.values()) / len(per_seq)), 4)
    log(f"{source}: {link}, one GPU predicted/measured "
        + ", ".join(f"{s}: {v:.3f}" for s, v in sorted(per_seq.items()))
        + f" -> attention rate x {anchor}")
    out = {"source": source, "link": link,
           "anchor": {"attention_scale": anchor, "pred_over_meas_one_gpu": per_seq}}
    fitted = {id(r): None for r in ours}
    held = {id(r): None for r in ours}
    multi = [r for r in ours if (r.get("mesh") or [1, 1])[0] > 1]
    if link == "emulated" and multi:
        lf = out["link_fit"] = fit_link_held_out(sim, multi, anchor, held, log)
        over = (anchor, lf["bandwidth_scale"], lf["interference"])
        for r, p in zip(multi, sim.many(multi, over)):
            fitted[id(r)] = p
    calib = sim.many(ours, one)
    anchored = sim.many(ours, (anchor, 1.0, None))
    rows = []
    for r, pc, pa in zip(ours, calib, anchored):
        rows.append({"config": r["config"], "seq": r["seq"], "mesh": r.get("mesh") or [1, 1],
                     "ms": r["ms"], "pred_calibration_ms": pc, "pred_anchored_ms": pa,
                     "pred_fitted_ms": fitted[id(r)], "pred_held_out_ms": held[id(r)]})
    out["runs"] = rows
    out["stats"] = {col: _log_stats([x["ms"] / x[f"pred_{col}_ms"] for x in rows
                                     if x[f"pred_{col}_ms"]])
                    for col in ("calibration", "anchored", "fitted", "held_out")}
    out["fitted_topology"] = apply(sim.base, anchor, *(
        (out["link_fit"]["bandwidth_scale"], out["link_fit"]["interference"])
        if "link_fit" in out else (1.0, None)))
    return out


def markdown(doc: dict) -> list[str]:
    """The report's section for a fit-runs.json document."""
    cols = (("calibration", "calibration only"), ("anchored", "compute anchored"),
            ("fitted", "+ link fitted (in-sample)"), ("held_out", "+ link fitted, S held out"))
    lines = ["## Simulator fitted to the runs", "",
             "meas/pred of every ditscale run: from the calibration alone; with the attention "
             "rate anchored to the launch's own one-GPU run; with the emulated link's bandwidth "
             "scale and compute interference fitted to the launch's multi-machine runs "
             "(in-sample); and fitted with that sequence length left out (held out: the figure "
             "to trust). `python -m bench.sp.fit_runs` (its docstring says why each step). "
             f"Within {WITHIN:.0%}: runs whose meas/pred is in [{1 - WITHIN:.2f}, "
             f"{1 + WITHIN:.2f}].", ""]
    for launch in doc["launches"]:
        a = launch["anchor"]
        lines.append(f"### {launch['link']} ({Path(launch['source']).name})")
        lines.append("")
        lines.append(f"- one GPU predicted/measured: " + ", ".join(
            f"S = {s}: {v:.3f}" for s, v in sorted(a["pred_over_meas_one_gpu"].items(),
                                                   key=lambda kv: int(kv[0])))
                     + f"; attention rate x {a['attention_scale']}")
        lf = launch.get("link_fit")
        if lf:
            measured = lf.get("measured_interference")
            lines.append(f"- link fitted on all lengths: bandwidth x {lf['bandwidth_scale']}, "
                         f"interference {lf['interference']}"
                         + (f" (calibrate.py measured {measured})" if measured is not None
                            else "")
                         + f", RMS log error {lf['rms_log']:.3f} (bandwidth alone, f = 0: x "
                         f"{lf['bandwidth_only']['bandwidth_scale']}, "
                         f"{lf['bandwidth_only']['rms_log']:.3f}); "
                         + "; ".join(f"S = {s} held out: x {h['bandwidth_scale']}, "
                                     f"{h['interference']}" for s, h in lf["held_out"].items()))
        for col, label in cols:
            st = launch["stats"][col]
            if st["n"]:
                lines.append(f"- {label}: meas/pred {st['min']:.2f}-{st['max']:.2f}x, "
                             f"{st['within']}/{st['n']} within {WITHIN:.0%}, "
                             f"RMS log error {st['rms_log']:.3f}")
        lines += ["", "| configuration | S | mesh | ms | " + " | ".join(
            label for _, label in cols) + " |", "|---|--:|---|--:|" + "--:|" * len(cols)]
        for r in launch["runs"]:
            cells = [f"{r['ms'] / r[f'pred_{c}_ms']:.2f}x" if r[f"pred_{c}_ms"] else "-"
                     for c, _ in cols]
            lines.append(f"| {r['config']} | {r['seq']:,} | {r['mesh'][0]}x{r['mesh'][1]} | "
                         f"{r['ms']:.4g} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="+", help="JSON files of bench_sp_attention.py")
    p.add_argument("--calib-dir", required=True, type=Path,
                   help="output of `calibrate.py fit` (topology-h200.json, ...)")
    p.add_argument("--ditscale", default=None, help="path of the ditscale CLI")
    a = p.parse_args(argv)
    cli = find_cli(a.ditscale)
    if cli is None:
        print("fit_runs: the ditscale CLI was not found (build it, or give --ditscale)",
              file=sys.stderr)
        return 2
    if not (a.calib_dir / "topology-h200.json").exists():
        print(f"fit_runs: {a.calib_dir / 'topology-h200.json'}: missing (run calibrate.py fit)",
              file=sys.stderr)
        return 2
    launches = []
    for path in a.results:
        try:
            doc = json.loads(Path(path).read_text())
            launches.append(fit_launch(doc, path, cli, a.calib_dir))
        except (OSError, json.JSONDecodeError, ValueError, KeyError, RuntimeError) as e:
            print(f"fit_runs: {path}: {e}", file=sys.stderr)
            return 2
    out = {"kind": "ditscale-sp-fit-runs", "version": 1, "within": WITHIN,
           "launches": launches}
    (a.calib_dir / "fit-runs.json").write_text(json.dumps(out, indent=1) + "\n")
    wrote = [str(a.calib_dir / "fit-runs.json")]
    for launch in launches:
        if launch["link"] == "emulated" and "link_fit" in launch:
            t = dict(launch["fitted_topology"], name="h200-emulated-fitted")
            path = a.calib_dir / "topology-h200-emulated-fitted.json"
            path.write_text(json.dumps(t, indent=1) + "\n")
            err = simulator_cli.check_with_cli(cli, path, 2, 1)
            if err:
                print(f"fit_runs: {path} rejected by the CLI: {err}", file=sys.stderr)
                return 1
            wrote.append(str(path))
    print("\n".join(markdown(out)))
    print("wrote " + ", ".join(wrote))
    return 0


if __name__ == "__main__":
    sys.exit(main())
