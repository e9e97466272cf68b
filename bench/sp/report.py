"""Markdown report (and a PNG bar chart) of the SwiftFusion attention benchmark.

  python -m bench.sp.report RESULTS.json [MORE.json ...] --out sp-attention.md \
      [--calib-dir DIR] [--png FILE.png] [--ditscale PATH] [--summary]

RESULTS are the files of bench_sp_attention.py (one per launch: NVLink, emulated machines);
--calib-dir is the output of `calibrate.py fit` (else the "h200-local" preset predicts). One
table per S and link: ms per layer, speed-ups, the speed-of-light reached, the simulator's
prediction, the check; the columns and the speed-of-light formula: docs/sp_benchmarks.md.
--summary prints a short plain-text table (gpu_check.sh shows it last).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

from bench import reporter
from bench.common import find_cli
from bench.sp import fit_runs, simulator_cli  # (no torch import at module level)

GIB = 1024**3
FLUX = {"text": 512, "heads": 24, "head_dim": 128}
# Measured earlier on the same 2 x H200 host at S + T = 66,048 (the reference numbers).
REFERENCE_66048 = {
    "nvlink": {"1 GPU (cuDNN)": 88.3, "plain Ulysses": 47.3, "PyTorch CP": 46.3},
    "emulated": {"plain Ulysses": 253.0, "PyTorch CP": 175.0},
}
ONE_SIDED = ("nvshmem", "nvshmem-intra")  # bench_sp_attention.py's one-sided transports
TRANSPORT_TITLE = {"nvshmem": "NVSHMEM", "nvshmem-intra": "NVSHMEM-intra"}
PRESET_BW = {"intra": 263 * GIB, "inter": 1.8 * GIB}  # h200-local (topology.cc)
LINK_TITLE = {"nvlink": "NVLink (one host, NCCL P2P)",
              "emulated": "Emulated machines (NCCL socket transport between them)"}


def peer_bytes_per_rank(peer: str, batch: int, heads: int, tokens: int, head_dim: int,
                        ranks: int, dtype_bytes: int = 2) -> float:
    """Bytes each rank sends (= receives) in one layer of a peer over L = tokens:
    plain Ulysses 4 * B * (L/N) * H * D * e * (N-1)/N (q, k, v to head shards, out back);
    PyTorch CP (ring) 2 * B * (L/N) * H * D * e * (N-1) (k and v of the N-1 other blocks)."""
    shard = batch * (tokens / ranks) * heads * head_dim * dtype_bytes
    if peer == "plain-ulysses":
        return 4 * shard * (ranks - 1) / ranks
    if peer == "torch-cp":
        return 2 * shard * (ranks - 1)
    raise ValueError(f"peer_bytes_per_rank: unknown peer '{peer}'")


def load_results(paths: list[str]) -> list[dict]:
    docs = []
    for p in paths:
        try:
            d = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"report: {p}: {e}")
        if d.get("kind") != "ditscale-sp-attention-bench":
            raise SystemExit(f"report: {p}: field 'kind': not a bench_sp_attention.py result")
        for i, r in enumerate(d.get("runs", [])):
            for key in ("seq", "config", "impl", "status", "link"):
                if key not in r:
                    raise SystemExit(f"report: {p}: runs[{i}]: missing field '{key}'")
        d["_path"] = p
        docs.append(d)
    return docs


class Predictor:
    """Simulator predictions through the CLI, cached; None where no cluster applies."""

    def __init__(self, cli: Optional[str], calib_dir: Optional[Path]):
        self.cli = cli
        self.calib = None
        self.fit_runs = None  # fit_runs.py's document, when the calibration folder has one
        self.topo = self.topo_machines = None
        if calib_dir is not None:
            t = calib_dir / "topology-h200.json"
            tm = calib_dir / "topology-h200-nvlink-machines.json"
            self.topo = str(t) if t.exists() else None
            self.topo_machines = str(tm) if tm.exists() else None
            c = calib_dir / "calibration.json"
            if c.exists():
                self.calib = json.loads(c.read_text())
            fr = calib_dir / "fit-runs.json"
            if fr.exists():
                self.fit_runs = json.loads(fr.read_text())
        self.cache: dict = {}
        self.errors: list[str] = []

    def bandwidth(self, key: str) -> float:
        """Best measured per-direction bandwidth of link `key` (intra | inter): send/recv or,
        when faster, all_gather; the preset's without a calibration."""
        fits = (self.calib or {}).get("fits", {})
        if key in fits:
            return max(fits[key]["bandwidth_Bps"], fits[key].get("all_gather_Bps", 0))
        return PRESET_BW[key]

    def cluster(self, link: str, mesh: list) -> Optional[str]:
        machines = mesh[0] if mesh else 1
        if link == "nvlink" and machines > 1:
            return self.topo_machines  # 2 NVLink GPUs as logical machines: no preset fits
        return self.topo or "h200-local"

    def predict(self, run: dict, shape: dict) -> Optional[dict]:
        if self.cli is None or run.get("status") != "ok":
            return None
        if any(shape.get(k) != v for k, v in FLUX.items()) or shape.get("batch", 1) < 1:
            return None  # the simulator's Flux preset has these
        impl, strategy = run["impl"], run["strategy"]
        mesh = run.get("mesh") or [1, 1]
        if impl == "single":
            mesh, strategy = [1, 1], "ulysses"
        elif impl == "peer":
            strategy = {"plain-ulysses": "ulysses", "torch-cp": "ring"}[strategy]
        cluster = self.cluster(run["link"], mesh)
        if cluster is None:
            return None
        transport = (run.get("transport") or "nccl") if impl == "ditscale" else "nccl"
        comm_sms = run.get("comm_sms", 0) if impl == "ditscale" else 0
        key = (cluster, tuple(mesh), strategy, run["seq"], run.get("chunks", 1), transport,
               shape.get("batch", 1), comm_sms)
        if key not in self.cache:
            try:
                self.cache[key] = simulator_cli.simulate(
                    self.cli, cluster, mesh[0], mesh[1], strategy, run["seq"],
                    chunks=run.get("chunks", 1), batch=key[6], transport=transport,
                    comm_sms=comm_sms)
            except Exception as e:  # a missing prediction must not lose the measured table
                self.errors.append(str(e))
                self.cache[key] = None
        return self.cache[key]


def fmt_ms(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.1f}" if x >= 100 else f"{x:.2f}")


def fmt_x(x: Optional[float]) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}x"


class Report:
    def __init__(self, docs: list[dict], pred: Predictor):
        self.docs, self.pred = docs, pred
        # (link, seq) -> list of (run, doc)
        self.groups: dict = defaultdict(list)
        for d in docs:
            for r in d["runs"]:
                self.groups[(r["link"], r["seq"])].append((r, d))
        self.single_ms: dict[int, float] = {}  # one GPU does not depend on the link
        for (link, seq), items in self.groups.items():
            for r, _ in items:
                if r["impl"] == "single" and r["status"] == "ok":
                    if seq not in self.single_ms or link == "nvlink":
                        self.single_ms[seq] = r["ms"]

    def baseline(self, link: str, seq: int, impl: str, strategy: str) -> Optional[float]:
        for r, _ in self.groups.get((link, seq), []):
            if r["impl"] == impl and r["strategy"] == strategy and r["status"] == "ok":
                return r["ms"]
        return None

    def sol_ms(self, r: dict, shape: dict, sim: Optional[dict]) -> Optional[float]:
        b, h, d, t = shape["batch"], shape["heads"], shape["head_dim"], shape["text"]
        L = r["seq"] + t
        flops = 4.0 * b * h * L * L * d
        mesh = r.get("mesh") or [1, 1]
        n = 1 if r["impl"] == "single" else mesh[0] * mesh[1]
        single = self.single_ms.get(r["seq"])
        if single is not None:
            rate = flops / (single * 1e-3)
        else:
            att = ((self.pred.calib or {}).get("fits", {}).get("attention") or {})
            if "attention_flops" not in att:
                return None
            rate = att["attention_flops"]
        compute_s = flops / (n * rate)
        if n == 1:
            return compute_s * 1e3
        intra_bw, inter_bw = self.pred.bandwidth("intra"), self.pred.bandwidth("inter")
        if r["impl"] == "peer":
            total = peer_bytes_per_rank(r["strategy"], b, h, L, d, n)
            inter = total if r["link"] == "emulated" else 0.0
            intra = total - inter
        elif sim is not None:
            inter, intra = sim["max_inter_bytes_per_rank"], sim["max_intra_bytes_per_rank"]
            if r["link"] == "nvlink":  # logical machines on one host still talk over NVLink
                inter, intra = 0.0, inter + intra
        else:
            return compute_s * 1e3
        comm_s = max(inter / inter_bw, intra / intra_bw)
        return max(compute_s, comm_s) * 1e3

    def table(self, link: str, seq: int) -> list[str]:
        items = self.groups[(link, seq)]
        shape = items[0][1]["shape"]
        one = self.single_ms.get(seq)
        uly = self.baseline(link, seq, "peer", "plain-ulysses")
        cp = self.baseline(link, seq, "peer", "torch-cp")
        lines = [
            f"### S = {seq:,} image + {shape['text']} text tokens ({link})",
            "",
            "| configuration | mesh | ms | vs 1 GPU | vs plain Ulysses | vs PyTorch CP "
            "| SOL ms | % of SOL | predicted ms | meas/pred | check (rel err) |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
        ]
        for r, d in items:
            chk = d.get("checks", {}).get(r["config"])
            if chk is None:
                chk_s = "-"
            elif "rel_err" in chk:
                chk_s = f"{'ok' if chk['ok'] else '**FAIL**'} ({chk['rel_err']:.1e})"
            else:
                chk_s = f"**error**: {chk.get('error', '?')}"
            mesh = "x".join(str(x) for x in (r.get("mesh") or [])) or "-"
            if r["status"] != "ok":
                lines.append(f"| {r['config']} | {mesh} | {r['status']}: {r.get('note', '')} "
                             f"| | | | | | | | {chk_s} |")
                continue
            ms = r["ms"]
            sim = self.pred.predict(r, shape)
            pred_ms = sim["predicted_layer_s"] * 1e3 if sim else None
            approx = "~" if sim and r["impl"] == "peer" else ""
            sol = self.sol_ms(r, shape, sim)
            name = r["config"] + (f" ({r['note']})" if r.get("note") else "")
            lines.append(
                f"| {name} | {mesh} | {fmt_ms(ms)} | {fmt_x(one / ms if one else None)} "
                f"| {fmt_x(uly / ms if uly else None)} | {fmt_x(cp / ms if cp else None)} "
                f"| {fmt_ms(sol)} | {'-' if sol is None else f'{100 * sol / ms:.0f}%'} "
                f"| {approx}{fmt_ms(pred_ms)} | {fmt_x(ms / pred_ms if pred_ms else None)} "
                f"| {chk_s} |")
        return lines + [""]

    def transports(self) -> list[str]:
        pairs: dict = defaultdict(dict)
        for (link, seq), items in self.groups.items():
            for r, _ in items:
                if r["impl"] == "ditscale" and r["status"] == "ok":
                    k = (link, seq, r["strategy"], r.get("chunks", 1), tuple(r.get("mesh") or []),
                         r.get("comm_sms", 0))
                    pairs[k][r.get("transport", "nccl")] = r["ms"]
        # One-sided columns that some row pairs with an NCCL run: "nvshmem" (puts on every link),
        # "nvshmem-intra" (puts within machines, NCCL between them; emulated machines).
        cols = [t for t in ONE_SIDED if any("nccl" in v and t in v for v in pairs.values())]
        rows = [(k, v) for k, v in sorted(pairs.items())
                if "nccl" in v and any(t in v for t in cols)]
        if not rows:
            return []
        head = "".join(f" {TRANSPORT_TITLE[t]} ms | {TRANSPORT_TITLE[t]} speed-up |" for t in cols)
        lines = ["## NCCL vs NVSHMEM (two-sided vs one-sided transport)", "",
                 "NVSHMEM-intra: puts within machines, NCCL send/recv between them.", "",
                 f"| link | S | strategy | mesh | NCCL ms |{head}",
                 "|---|--:|---|---|--:|" + "--:|--:|" * len(cols)]
        for (link, seq, strat, chunks, mesh, comm_sms), v in rows:
            name = strat + (f" c{chunks}" if strat == "torus" else
                            f" h{chunks}" if chunks > 1 else "")
            name += f" comm_sms={comm_sms}" if comm_sms else ""
            cells = "".join(f" {fmt_ms(v.get(t))} | {fmt_x(v['nccl'] / v[t] if t in v else None)} |"
                            for t in cols)
            lines.append(f"| {link} | {seq:,} | {name} | {'x'.join(map(str, mesh))} "
                         f"| {fmt_ms(v['nccl'])} |{cells}")
        return lines + [""]

    def calibration(self) -> list[str]:
        c = self.pred.calib
        if not c:
            return ["Simulator: the `h200-local` preset (no calibration given).", ""]
        f = c["fits"]
        lines = ["## Calibration (this machine)", "", "| quantity | measured |", "|---|---|"]
        for key, label in (("intra", "NVLink"), ("inter", "socket between emulated machines")):
            if key not in f:
                continue
            x = f[key]
            ag = (f", all_gather {x['all_gather_Bps'] / 1e9:.2f} GB/s received per rank"
                  if x.get("all_gather_Bps") else "")
            lines.append(f"| {label}: NCCL send/recv per direction, both ways at once | "
                         f"{x['bandwidth_Bps'] / 1e9:.2f} GB/s, small message "
                         f"{x['latency_s'] * 1e6:.1f} us{ag} |")
        if "attention" in f:
            a = f["attention"]
            lines.append(f"| cuDNN attention hd 128 (fit of {a['points']} blocks) | "
                         f"{a['attention_flops'] / 1e12:.0f} TFLOP/s asymptotic, half-efficiency "
                         f"block {a['attention_half_tokens']:.0f} tokens (rms error "
                         f"{a['rms_rel_err']:.1%}) |")
        if f.get("hbm_Bps"):
            lines.append(f"| HBM copy (read + write) | {f['hbm_Bps'] / 1e9:.0f} GB/s |")
        if f.get("linear_flops"):
            lines.append(f"| bf16 GEMM 16384x3072x12288 | {f['linear_flops'] / 1e12:.0f} TFLOP/s |")
        return lines + ["", "Predictions use `topology-h200.json` (and "
                        "`topology-h200-nvlink-machines.json` for a logical 2x1 mesh on NVLink).",
                        ""]

    def runs(self) -> list:
        """Each run's header (bench.reporter: device, commit, command, date), when it has one."""
        docs = [d for d in self.docs if d.get("header")]
        if not docs:
            return []
        rows = [[d["link"], d["header"]["device"], d["header"]["commit"], d["header"]["date"],
                 f"`{d['header']['command']}`"] for d in docs]
        return ["Runs:", "", reporter.table(["link", "device", "commit", "date", "command"],
                                            rows)]

    def markdown(self, png_name: Optional[str]) -> str:
        d0 = self.docs[0]
        out = [
            f"# SwiftFusion attention layer on {d0.get('world_size', '?')} x {d0.get('gpu', '?')}",
            "",
            f"Flux attention: B={d0['shape']['batch']}, {d0['shape']['heads']} heads x "
            f"{d0['shape']['head_dim']}, {d0['shape']['text']} joint text tokens, bf16, "
            "non-causal. torch " + str(d0.get("torch")) + ", NCCL " + str(d0.get("nccl")) +
            f", host {d0.get('host')}.",
            "",
            "Timing: " + d0["timing"]["statistic"] + "; " + ", ".join(
                f"{d['link']}: {d['timing']['warmup']} warm-up, {d['timing']['iters']} "
                f"iterations x {d['timing']['repeats']} repeats" for d in self.docs) +
            ". Every configuration's output was checked once against fp32 SDPA at the check size "
            "(relative Frobenius error, tolerance 2e-2).",
            "",
            "SOL = speed-of-light: max(attention FLOPs / (N x one-GPU FLOP/s at that S), bytes "
            "per rank / the best measured per-direction link bandwidth). Above 100% means the "
            "strategy beat a bandwidth that the calibration under-measured.",
            "",
        ]
        out += self.runs()
        out += self.calibration()
        for link in ("nvlink", "emulated"):
            seqs = sorted(s for (l, s) in self.groups if l == link)
            if not seqs:
                continue
            out += [f"## {LINK_TITLE[link]}", ""]
            for s in seqs:
                out += self.table(link, s)
        out += self.transports()
        if self.pred.fit_runs:
            # Only the launches of this report (fit-runs.json may describe other files).
            names = {Path(d["_path"]).name for d in self.docs}
            launches = [x for x in self.pred.fit_runs.get("launches", [])
                        if Path(x["source"]).name in names]
            if launches:
                out += fit_runs.markdown(dict(self.pred.fit_runs, launches=launches))
        out += ["## Reference (measured earlier on this host, S + T = 66,048)", "",
                "| link | configuration | ms |", "|---|---|--:|"]
        for link, v in REFERENCE_66048.items():
            for k, ms in v.items():
                out.append(f"| {link} | {k} | {ms} |")
        out.append("")
        notes = [f"- {d['_path']}: ditscale.sp unavailable ({d.get('ditscale_sp_error')})"
                 for d in self.docs if not d.get("ditscale_sp", True)]
        if self.pred.cli is None:
            notes.append("- ditscale CLI not found: no predictions")
        notes += [f"- prediction failed: {e}" for e in sorted(set(self.pred.errors))]
        if notes:
            out += ["## Notes", ""] + notes + [""]
        if png_name:
            out += [f"![ms per attention layer]({png_name})", ""]
        return "\n".join(out)

    def summary(self) -> str:
        lines = [f"{'link':<9} {'S':>7} {'1 GPU':>8} {'Ulysses':>8} {'torch CP':>8} "
                 f"{'best ditscale':<34} {'ms':>8} {'vs 1GPU':>8} {'vs CP':>7} {'checks':>7}"]
        for (link, seq) in sorted(self.groups):
            items = self.groups[(link, seq)]
            ds = [(r, d) for r, d in items if r["impl"] == "ditscale" and r["status"] == "ok"]
            best = min(ds, key=lambda x: x[0]["ms"])[0] if ds else None
            one = self.single_ms.get(seq)
            cp = self.baseline(link, seq, "peer", "torch-cp")
            uly = self.baseline(link, seq, "peer", "plain-ulysses")
            fails = sum(1 for r, d in items if not d.get("checks", {}).get(r["config"], {})
                        .get("ok", True))
            lines.append(
                f"{link:<9} {seq:>7} {fmt_ms(one):>8} {fmt_ms(uly):>8} {fmt_ms(cp):>8} "
                f"{(best['config'] if best else '-'):<34} "
                f"{fmt_ms(best['ms'] if best else None):>8} "
                f"{fmt_x(one / best['ms'] if best and one else None):>8} "
                f"{fmt_x(cp / best['ms'] if best and cp else None):>7} "
                f"{'ok' if fails == 0 else f'{fails} FAIL':>7}")
        return "\n".join(lines)


def plot(rep: Report, path: Path) -> bool:
    """Bar chart of ms per layer, one panel per (link, S); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib not installed: no PNG", file=sys.stderr)
        return False
    keys = sorted(rep.groups)
    if not keys:
        return False
    n = max(len(rep.groups[k]) for k in keys)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 0.32 * n + 1.8),
                             squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = [r for r, _ in rep.groups[key] if r["status"] == "ok"]
        names = [r["config"] + (" " + "x".join(map(str, r["mesh"])) if r["impl"] == "ditscale"
                                else "") for r in rows]
        colors = ["tab:gray" if r["impl"] == "single" else "tab:orange" if r["impl"] == "peer"
                  else "tab:blue" for r in rows]
        ax.barh(range(len(rows)), [r["ms"] for r in rows], color=colors)
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per attention layer")
        ax.set_title(f"{key[0]}, S={key[1]:,}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="+", help="JSON files of bench_sp_attention.py")
    p.add_argument("--out", required=True, type=Path, help="markdown file to write")
    p.add_argument("--calib-dir", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None, help="default: OUT with .png")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--ditscale", default=None, help="path of the ditscale CLI")
    p.add_argument("--summary", nargs="?", const="-", default=None, metavar="FILE",
                   help="write a short plain-text table to FILE (stdout without FILE)")
    a = p.parse_args(argv)
    docs = load_results(a.results)
    rep = Report(docs, Predictor(find_cli(a.ditscale), a.calib_dir))
    png = None
    if not a.no_png:
        png = a.png or a.out.with_suffix(".png")
        if not plot(rep, png):
            png = None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(rep.markdown(os.path.relpath(png, a.out.parent) if png else None))
    print(f"wrote {a.out}" + (f" and {png}" if png else ""), file=sys.stderr)
    if a.summary == "-":
        print(rep.summary())
    elif a.summary:
        Path(a.summary).write_text(rep.summary() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
