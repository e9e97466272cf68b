#!/usr/bin/env python3
"""Where the server's pipeline call spends its extra time: two py-spy profiles in one.

    py-spy record --subprocesses --idle --threads --nonblocking -r 200 -f raw -o P.txt -- \\
        python -m bench.serve.bench_serve --pipelines flux --clients 1 ...
    python -m bench.serve.pyspy_compare P.txt [--depth 1] [--top 25]

Of the raw (collapsed-stack) profile, the samples of the pipeline call of each side: in the
bench process, the stacks through ``direct (bench_serve.py)``; in the server process, those
through ``execute (runner.py)``; both cut at the pipeline's ``__call__`` frame. The table
gives, per frame ``--depth`` levels below ``__call__`` (1: the pipeline's own lines) and per
leaf frame, the samples of each side and their difference, largest first; with one call
count per side (``--clients 1``: the same number of calls), a difference is the extra time of
that line or function (samples / rate = seconds).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

SIDES = (("direct", re.compile(r"^(\w+\.)?direct \(.*bench_serve\.py:\d+\)$")),
         ("server", re.compile(r"^execute \(.*runner\.py:\d+\)$")))
CALL = re.compile(r"^\w+Pipeline\.__call__ \(.*diffusers/pipelines/.*\.py:\d+\)$")


def parse(path: str):
    """Yields (side, frames below the pipeline's __call__, samples) of each stack."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                raise ValueError(f"{path}:{lineno}: not a 'frames count' line of py-spy's raw "
                                 f"format")
            frames = stack.split(";")
            side = next((name for name, pat in SIDES if any(pat.match(fr) for fr in frames)),
                        None)
            if side is None:
                continue
            at = next((i for i, fr in enumerate(frames) if CALL.match(fr)), None)
            if at is None:
                continue
            yield side, frames[at + 1:], int(count)


def compare(path: str, depth: int):
    totals = collections.Counter()
    by_line = {s: collections.Counter() for s, _ in SIDES}
    by_leaf = {s: collections.Counter() for s, _ in SIDES}
    for side, below, n in parse(path):
        totals[side] += n
        by_line[side][";".join(below[:depth]) or "(the __call__ frame itself)"] += n
        by_leaf[side][below[-1] if below else "(the __call__ frame itself)"] += n
    return totals, by_line, by_leaf


def table(title: str, counts, top: int) -> str:
    keys = set(counts["direct"]) | set(counts["server"])
    rows = sorted(keys, key=lambda k: -abs(counts["server"][k] - counts["direct"][k]))[:top]
    out = [f"## {title}", "", "| frame | direct | server | server - direct |", "|---|---|---|---|"]
    for k in rows:
        d, s = counts["direct"][k], counts["server"][k]
        out.append(f"| `{k[-120:]}` | {d} | {s} | {s - d:+d} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--depth", type=int, default=1, help="frames below __call__, [1, 50]")
    ap.add_argument("--top", type=int, default=25, help="rows per table, [1, 1000]")
    args = ap.parse_args(argv)
    for name, v, hi in (("depth", args.depth, 50), ("top", args.top, 1000)):
        if not 1 <= v <= hi:
            ap.error(f"--{name}: {v} is out of range [1, {hi}]")
    try:
        totals, by_line, by_leaf = compare(args.profile, args.depth)
    except (OSError, ValueError) as e:
        print(f"pyspy_compare: error: {e}", file=sys.stderr)
        return 2
    if not totals:
        print(f"pyspy_compare: error: {args.profile}: no pipeline call of either side "
              f"(was it recorded with --subprocesses?)", file=sys.stderr)
        return 1
    print(f"samples in the pipeline call: direct {totals['direct']}, server {totals['server']} "
          f"({totals['server'] / max(1, totals['direct']) - 1:+.1%})\n")
    print(table(f"by frame {args.depth} below the pipeline's __call__", by_line, args.top))
    print()
    print(table("by leaf frame", by_leaf, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
