#!/usr/bin/env python3
"""One table across rank counts of the parallel VAE decode: the vae-decode-multi-N.md files of
bench.diffusers.vae_decode_multi (one per N) -> vae-multi-summary.md.

    python -m bench.diffusers.vae_multi_summary --dir DIR [--out-dir DIR]

Per case and N: ``parallelize_vae``'s decode time (the slowest rank's median) and its speed-up
against the stock decode at N = 1 (one GPU, the whole video: what a user runs without ditscale),
the per-rank peak activations against the stock decode's at N = 1, the error against the stock
decode at the same N, and the targets of docs/diffusers/vae.md (>= 1.8x at 2 ranks, >= 6x at 8).
Cases without a stock row at N = 1 are summarised against the stock decode of the smallest N
(said in the row). Reads only the files' markdown tables (bench/reporter.py's format).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Tuple

from bench import reporter

TARGETS = {2: 1.8, 8: 6.0}
NEEDED = ("case", "mode", "ranks", "median ms")
FILE = re.compile(r"^vae-decode-multi-(\d+)\.md$")
COLUMNS = ["case", "ranks", "stock ms (N=1)", "parallel ms", "speed-up", "target",
           "peak MiB (N=1 stock)", "peak MiB per rank", "peak ratio", "tiling ms", "rel. error"]


def read_rows(path: str) -> List[Dict[str, str]]:
    """The rows of the file's table whose header has "case" and "mode", as column -> cell."""
    rows, header = [], None
    with open(path) as f:
        for line in f:
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells if {"case", "mode"} <= set(cells) else []
            elif header and not line.startswith("|---"):
                rows.append(dict(zip(header, cells)))
    return rows


def collect(folder: str) -> Dict[Tuple[str, str, int], Dict[str, str]]:
    """(case, mode, N) -> row over every vae-decode-multi-N.md of ``folder``; ValueError when
    there is none, or a file's N differs from its rows' ranks."""
    found = {}
    names = sorted(n for n in os.listdir(folder) if FILE.match(n))
    if not names:
        raise ValueError(f"--dir: {folder!r} has no vae-decode-multi-N.md")
    for name in names:
        n = int(FILE.match(name).group(1))
        for row in read_rows(os.path.join(folder, name)):
            missing = [c for c in NEEDED if c not in row]
            if missing:
                raise ValueError(f"{name}: its table has no column {missing[0]!r}")
            if row["ranks"] != str(n):
                raise ValueError(f"{name}: a row of {row['ranks']} ranks in the file of {n}")
            found[(row["case"], row["mode"], n)] = row
    return found


def _num(cell: str):
    try:
        return float(cell)
    except (TypeError, ValueError):
        return None


def case_rows(case: str, found) -> List[list]:
    """The summary rows of ``case``: one per N with a parallel row."""
    ns = sorted(n for (c, m, n) in found if c == case and m == "parallel")
    stock_ns = sorted(n for (c, m, n) in found if c == case and m == "stock")
    if not ns or not stock_ns:
        return []
    base_n = stock_ns[0]
    base = found[(case, "stock", base_n)]
    t0, p0 = _num(base["median ms"]), _num(base.get("peak act. MiB"))
    rows = []
    for n in ns:
        par = found[(case, "parallel", n)]
        t, p = _num(par["median ms"]), _num(par.get("peak act. MiB"))
        speed = t0 / t if t0 and t else None
        target = TARGETS.get(n)
        verdict = "-" if target is None or speed is None else \
            f">= {target}x: {'met' if speed >= target else 'not met'}"
        tiling = found.get((case, "tiling", n), {}).get("median ms", "-")
        label = case if base_n == 1 else f"{case} (stock at N={base_n})"
        rows.append([label, n, t0, t, "-" if speed is None else f"{speed:.2f}x", verdict,
                     "-" if p0 is None else p0, "-" if p is None else p,
                     f"{p / p0:.2f}" if p and p0 else "-", tiling, par.get("rel. error", "-")])
    return rows


def summary(folder: str) -> str:
    found = collect(folder)
    cases = list(dict.fromkeys(c for (c, _, _) in found))
    rows = [r for case in cases for r in case_rows(case, found)]
    ns = sorted({n for (_, _, n) in found})
    notes = (f"From {', '.join(f'vae-decode-multi-{n}.md' for n in ns)}: speed-up = the stock "
             f"decode at N = 1 / parallelize_vae at N (each the slowest rank's median); peak: "
             f"the largest rank's activations; rel. error against the stock decode at the same "
             f"N; tiling: diffusers' tiling on one rank (the same at every N).")
    return reporter.report("Parallel VAE decode across rank counts", COLUMNS, rows, notes=notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.diffusers.vae_multi_summary",
                                description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the folder of the vae-decode-multi-N.md files")
    p.add_argument("--out-dir", default=None, help="where vae-multi-summary.md goes (default: "
                   "--dir)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        p.error(f"--dir: {args.dir!r} is not a folder")
    try:
        text = summary(args.dir)
    except ValueError as e:
        print(f"vae_multi_summary: error: {e}", file=sys.stderr)
        return 2
    reporter.write(os.path.join(args.out_dir or args.dir, "vae-multi-summary.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
