#!/usr/bin/env python3
"""ditscale against its peers on the same diffusers transformers: a fixed number of denoising
steps of Flux and Wan 2.1 1.3B, random weights of the real dimensions, one row per way of
running them on the ranks of one launch (stock, ditscale per strategy, diffusers' context
parallelism, xDiT).

    torchrun --nproc-per-node N -m bench.diffusers.compare_peers [--cases flux-2048,wan-480p]
        [--blocks 0] [--steps 3] [--warmup-steps 1] [--emulate-machines 2]
        [--baseline-json DIR/compare-peers-1gpu.json] [--out-dir DIR] [--tag NAME]
    python -m bench.diffusers.compare_peers --device cpu --size tiny ...   (gloo, CI)

Writes DIR/compare-peers-TAG.json and .md; exit status 1 if a row failed. The cases, rows,
columns and files: docs/diffusers/benchmarks.md; how each row's model is made: compare_rows.py.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Tuple

from bench import reporter
from bench.diffusers import compare_rows as R
from bench.diffusers.compare_models import (TEXT_TOKENS, TINY_GRID, build, denoise, make_inputs,
                                            model_config, stock_class)

GiB = float(1 << 30)

STRATEGIES = ("ulysses", "ulysses-overlap", "ring", "usp", "swiftfusion-tas", "torus")
PEERS = ("diffusers", "xfuser")


@dataclass(frozen=True)
class Case:
    family: str  # "flux" | "wan"
    grid: Tuple[int, int, int]  # patched (frames, h, w) at size full
    label: str


CASES = {
    "flux-2048": Case("flux", (1, 128, 128), "Flux 2048^2"),
    "flux-4096": Case("flux", (1, 256, 256), "Flux 4096^2"),
    "wan-480p": Case("wan", (21, 30, 52), "Wan 2.1 1.3B 81x480p"),
    "wan-720p": Case("wan", (21, 45, 80), "Wan 2.1 1.3B 81x720p"),
}


# ---- rows of one case ---------------------------------------------------------------------------

def run_row(prepare, family, inp, args, device) -> dict:
    """Makes the row's model (``prepare()``), runs the steps, frees it. Returns ms/step, peak
    bytes and the output (rank-local)."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
    model = prepare()
    if cuda:  # the peak of the steps (not of making the model: xfuser's is built in fp32 first)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    out, times = denoise(model, family, inp, args.warmup_steps + args.steps, device)
    peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else None
    del model
    if cuda:  # free the row's memory before the next row's accounting starts
        gc.collect()
    return {"ms": 1e3 * statistics.median(times[args.warmup_steps:]), "peak_bytes": peak,
            "out": out, "step_ms": [1e3 * s for s in times]}


def plan_rows(master, family, cfg, inp, mesh, args, device, world) -> list:
    """[(row name, skip reason or None, prepare)] of one case, in the order they run."""
    import copy

    plan = []
    if world == 1:
        plan.append(("stock", None, lambda: copy.deepcopy(master)))
        if device.type == "cuda":
            plan.append(("stock-cudnn", None, R.prepare_stock_cudnn(master)))
    for s in args.strategies:
        reason = R.mesh_skip(s, mesh) if s != "auto" else None
        plan.append((f"ditscale {s}", reason, R.prepare_ditscale(master, s)))
    if "diffusers" in args.peers:
        for kind in ("ulysses", "ring"):
            plan.append((f"diffusers-{kind}", R.diffusers_skip(kind, world, cfg, inp, device),
                         R.prepare_diffusers(master, kind, world, device)))
    if "xfuser" in args.peers:
        kinds = [("xfuser", 1, 1)] if world == 1 else [("xfuser-ulysses", world, 1),
                                                        ("xfuser-ring", 1, world)]
        for row, u, r in kinds:
            plan.append((row, R.xfuser_skip(world, device, cfg, u),
                         R.prepare_xfuser(master, family, cfg, inp, u, r, args, device)))
    return plan


def one_row(row, prepare, family, cfg, inp, mesh, args, device) -> None:
    """Runs one planned row into ``row`` (status ok with its numbers, or error)."""
    import torch.distributed as dist

    try:
        r = run_row(prepare, family, inp, args, device)
    except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
        row.update(status="error", reason=f"{type(e).__name__}: {e}"[:400])
        print(f"[compare_peers] rank {dist.get_rank()} {row['case']} {row['row']}: "
              f"{row['reason']}", file=sys.stderr, flush=True)
        return
    row.update(status="ok", **reduce_over_ranks(r, device), _out=r["out"])
    if row["row"] == "ditscale auto":
        row["auto_choice"] = R.auto_choice(mesh, family, cfg, inp, device)


def case_rows(name, case, args, device, world, baseline) -> list:
    """Every row of case ``name`` (dicts), with speed-up and rel. L2 filled in."""
    import torch
    import torch.distributed as dist

    from ditscale import sp

    family = case.family
    args.grid = case.grid if args.size == "full" else TINY_GRID[family]
    cfg = model_config(family, args.size, args.blocks)
    inp = make_inputs(family, args.grid, TEXT_TOKENS[args.size], cfg, args.torch_dtype, device,
                      args.seed)
    master = build(stock_class(family), cfg, args.torch_dtype, device, args.seed)
    with torch.no_grad():
        wsum = float(sum(p.double().sum() for p in master.parameters()))
    mesh = sp.Mesh.from_process_group()
    head = dict(case=name, label=case.label, world=world, machines=mesh.machines,
                tokens=inp.tokens, text=inp.text, blocks=args.blocks, size=args.size,
                dtype=args.dtype, steps=args.steps, warmup_steps=args.warmup_steps,
                weights_sum=wsum)
    rows = []
    for row_name, reason, prepare in plan_rows(master, family, cfg, inp, mesh, args, device,
                                               world):
        row = dict(head, row=row_name)
        if reason:
            row.update(status="skipped", reason=reason)
        else:
            one_row(row, prepare, family, cfg, inp, mesh, args, device)
        dist.barrier()
        rows.append(row)
        report_row(row)
    del master
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    finish_case(rows, name, args, baseline)
    return rows


def reduce_over_ranks(r, device) -> dict:
    """ms/step and peak bytes: the maximum over the ranks."""
    import torch
    import torch.distributed as dist

    v = torch.tensor([r["ms"], float(r["peak_bytes"] or 0)], dtype=torch.float64,
                     device=device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return {"ms": float(v[0]), "peak_gib": float(v[1]) / GiB if r["peak_bytes"] is not None
            else None, "step_ms": r["step_ms"]}


def report_row(row):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        what = (f"{row['ms']:.2f} ms/step" if row["status"] == "ok"
                else f"{row['status']}: {row['reason']}")
        print(f"[compare_peers] {row['case']} {row['row']}: {what}", flush=True)


def finish_case(rows, name, args, baseline) -> None:
    """Speed-up and rel. L2 of every row against the 1-GPU stock run; the stock output saved."""
    import torch

    base_ms, ref = None, None
    stock = [r for r in rows if r["row"] == "stock" and r["status"] == "ok"]
    if stock:  # world size 1: this launch's stock row
        base_ms, ref = stock[0]["ms"], stock[0]["_out"]
        stock[0]["output_file"] = f"compare-peers-{args.tag}-{name}.pt"
        torch.save(ref, os.path.join(args.out_dir, stock[0]["output_file"]))
    elif baseline is not None and name in baseline:
        b = baseline[name]
        for key in ("weights_sum", "tokens", "blocks", "size", "dtype", "steps",
                    "warmup_steps"):
            same = (math.isclose(b[key], rows[0][key], rel_tol=1e-9, abs_tol=1e-9)
                    if key == "weights_sum" else b[key] == rows[0][key])
            if not same:
                raise SystemExit(f"--baseline-json: case {name} has {key} {b[key]!r} there, "
                                 f"{rows[0][key]!r} in this run: not the same weights or inputs")
        base_ms, ref = b["ms"], b["out"]
    for r in rows:
        out = r.pop("_out", None)
        if out is None:
            continue
        r["speedup"] = base_ms / r["ms"] if base_ms else None
        r["rel_l2"] = float((out - ref).norm() / ref.norm().clamp_min(1e-30)) if ref is not None \
            else None


# ---- baseline, output ---------------------------------------------------------------------------

def load_baseline(path: str) -> dict:
    """case -> the stock row of a world-size-1 run's JSON, with its output tensor ("out")."""
    import torch

    where = f"--baseline-json {path!r}"
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{where}: cannot read it as JSON: {e}") from e
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise SystemExit(f"{where}: no 'rows' list (not a compare_peers JSON)")
    out = {}
    for r in rows:
        if r.get("row") != "stock" or r.get("status") != "ok" or r.get("world") != 1:
            continue
        file = os.path.join(os.path.dirname(os.path.abspath(path)), r["output_file"])
        if not os.path.isfile(file):
            raise SystemExit(f"{where}: the output of case {r['case']} ({file}) is missing")
        out[r["case"]] = dict(r, out=torch.load(file))
    if not out:
        raise SystemExit(f"{where}: no ok 'stock' row of a world-size-1 run")
    return out


def fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def table(rows) -> str:
    lines = ["| case | ranks | row | ms/step | speed-up | peak GiB | rel. L2 | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ranks = f"{r['world']}" + (f" ({r['machines']} machines)" if r["machines"] > 1 else "")
        if r["status"] != "ok":
            reason = " ".join(r["reason"].replace("|", "/").split())  # one table cell
            lines.append(f"| {r['case']} | {ranks} | {r['row']} | {r['status']} | | | | "
                         f"{reason} |")
            continue
        note = f"auto chose {r['auto_choice']}" if r.get("auto_choice") else ""
        lines.append(f"| {r['case']} | {ranks} | {r['row']} | {r['ms']:.2f} | "
                     f"{fmt(r.get('speedup'), '.2f')} | {fmt(r.get('peak_gib'), '.2f')} | "
                     f"{fmt(r.get('rel_l2'), '.1e')} | {note} |")
    return "\n".join(lines) + "\n"


def write(rows, args, world, final: bool) -> None:
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return
    meta = dict(world=world, emulate_machines=args.emulate_machines, device=args.device,
                dtype=args.dtype, size=args.size, blocks=args.blocks, steps=args.steps,
                warmup_steps=args.warmup_steps, seed=args.seed, complete=final,
                baseline_json=args.baseline_json)
    meta["header"] = reporter.header()
    path = os.path.join(args.out_dir, f"compare-peers-{args.tag}")
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if final:
        title = f"ditscale against diffusers' context parallelism and xDiT, {world} rank(s)"
        with open(path + ".md", "w") as f:
            f.write("\n".join(reporter.header_lines(title)) + "\n" + table(rows))


# ---- options, setup, main -----------------------------------------------------------------------

def _list(ap, name, text, choices):
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in choices]
    if bad:
        ap.error(f"--{name}: {', '.join(bad)} not in {', '.join(choices)}")
    return items


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--size", default="full", choices=("full", "tiny"))
    ap.add_argument("--blocks", type=int, default=0,
                    help="blocks of each kind, [0, 64]; 0 = the published counts")
    ap.add_argument("--steps", type=int, default=3, help="timed denoising steps, [1, 1000]")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed first steps, [0, 100]")
    ap.add_argument("--strategies", default="auto," + ",".join(STRATEGIES),
                    help="ditscale rows: comma-separated of auto, " + ", ".join(STRATEGIES))
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="peer rows: comma-separated of diffusers, xfuser ('' for none)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="auto: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--seed", type=int, default=0, help="weights and inputs, [0, 2^31 - 1]")
    ap.add_argument("--emulate-machines", type=int, default=0,
                    help="M >= 2: M emulated machines (ditscale.sp.emulate_machines); 0 = off")
    ap.add_argument("--baseline-json", default=None,
                    help="a world-size-1 run's JSON (needed at world size > 1 for the "
                         "speed-up and rel. L2 columns)")
    ap.add_argument("--timeout-s", type=int, default=900,
                    help="process-group timeout, [10, 3600] s")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default=None,
                    help="file name part, [A-Za-z0-9._-]+ (default: 1gpu, 2gpu-nvlink, "
                         "2gpu-emulated2, ...)")
    args = ap.parse_args(argv)
    from ditscale._checks import check_int

    for name, lo, hi in (("blocks", 0, 64), ("steps", 1, 1000), ("warmup_steps", 0, 100),
                         ("seed", 0, 2**31 - 1), ("timeout_s", 10, 3600),
                         ("emulate_machines", 0, 64)):
        try:
            check_int("--" + name.replace("_", "-"), getattr(args, name), lo, hi)
        except ValueError as e:
            ap.error(str(e))
    if args.emulate_machines == 1:
        ap.error("--emulate-machines: 1 is not an emulation; use 0 (off) or M >= 2")
    args.cases = _list(ap, "cases", args.cases, tuple(CASES))
    if not args.cases:
        ap.error("--cases: empty")
    args.strategies = _list(ap, "strategies", args.strategies, ("auto",) + STRATEGIES)
    args.peers = _list(ap, "peers", args.peers, PEERS)
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", args.tag):
        ap.error(f"--tag: {args.tag!r} is not of [A-Za-z0-9._-]+")
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.baseline_json is None:
        ap.error(f"--baseline-json: needed at world size {world} (the 1-GPU stock run's JSON)")
    if args.emulate_machines and world % args.emulate_machines:
        ap.error(f"--emulate-machines: {args.emulate_machines} does not divide world size {world}")
    return args


def init(args):
    """The process group (torchrun's, or one rank on a file store) and this rank's device."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("compare_peers: --device cuda but no GPU is visible (--device cpu)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)  # no device_id: xfuser's new_group needs a lazy init
    else:
        device = torch.device("cpu")
    if args.emulate_machines:
        from ditscale import sp

        sp.emulate_machines(args.emulate_machines)  # before NCCL starts
    timeout = datetime.timedelta(seconds=args.timeout_s)
    backend = "nccl" if args.device == "cuda" else "gloo"
    store = None
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = tempfile.NamedTemporaryFile(prefix="compare_peers_", delete=False).name
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timeout)
    return device, store


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist

    args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device, store = init(args)
    world = dist.get_world_size()
    if args.tag is None:
        args.tag = "1gpu" if world == 1 else (
            f"{world}gpu-emulated{args.emulate_machines}" if args.emulate_machines
            else f"{world}gpu-nvlink")
    os.makedirs(args.out_dir, exist_ok=True)
    baseline = load_baseline(args.baseline_json) if args.baseline_json else None
    rows = []
    try:
        for name in args.cases:
            rows += case_rows(name, CASES[name], args, device, world, baseline)
            write(rows, args, world, final=False)
        write(rows, args, world, final=True)
    finally:
        dist.destroy_process_group()
        if store and os.path.exists(store):  # the FileStore may have removed it
            os.unlink(store)
    if int(os.environ.get("RANK", "0")) == 0:
        print(table(rows), flush=True)
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
