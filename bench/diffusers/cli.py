"""The command line the diffusers benchmarks share: models, token counts, blocks, modes, repetitions
(each range-checked with its name), and writing the rows as JSON + a markdown table."""

from __future__ import annotations

import argparse
import json
import os

from bench.diffusers import models as M


def parser(doc: str, models: str, blocks: int, max_s: float) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=models, help=f"comma-separated, of {', '.join(M.MODELS)}")
    ap.add_argument("--tokens", default="", help="comma-separated token counts (default: each "
                    "model's typical ones)")
    ap.add_argument("--blocks", type=int, default=blocks, help="blocks of each kind, [1, 64]")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--warmup", type=int, default=3, help="[1, 100]")
    ap.add_argument("--reps", type=int, default=10, help="[3, 1000]")
    ap.add_argument("--max-s", type=float, default=max_s, help="seconds per variant, (0, 600]")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    return ap


def parse(ap: argparse.ArgumentParser, argv):
    """Parses and checks the shared options (lists split, ranges named in the errors)."""
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in M.MODELS]
    if bad:
        ap.error(f"--models: {bad} not in {', '.join(M.MODELS)}")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        ap.error(f"--tokens: {args.tokens!r} is not a comma-separated list of integers")
    if any(not 1 <= t <= 1 << 20 for t in args.tokens):
        ap.error(f"--tokens: {args.tokens} must be in [1, 1048576]")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in ("eager", "compile") for m in args.modes):
        ap.error(f"--modes: {args.modes} must be eager and/or compile")
    for name, lo, hi in (("blocks", 1, 64), ("warmup", 1, 100), ("reps", 3, 1000)):
        if not lo <= getattr(args, name) <= hi:
            ap.error(f"--{name}: {getattr(args, name)} is out of range [{lo}, {hi}]")
    if not 0 < args.max_s <= 600:
        ap.error(f"--max-s: {args.max_s} is out of range (0, 600]")
    return args


def write(out_dir: str, stem: str, rows, text: str, title: str) -> int:
    """DIR/stem.json (the rows) and DIR/stem.md (bench.reporter's header with ``title``, then
    the table), the table printed; 1 when a row failed."""
    from bench import reporter

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write("\n".join(reporter.header_lines(title)) + "\n" + text)
    print(text)
    return 1 if any("error" in r for r in rows) else 0


def sweep(who: str, args, default_tokens, compare):
    """One row per (model, tokens, mode) of ``args``: ``compare(name, tokens, compiled)`` ->
    (fields, summary) measures the pair (stock and the variant) and its fields fill the row; a
    pair that raises becomes a row with ``error`` (the others are kept). Each row is logged as
    ``[who] model tokens mode summary``."""
    import sys

    rows = []
    for name in args.models:
        for tokens in (args.tokens or default_tokens[name]):
            for mode in args.modes:
                row = {"model": name, "tokens": tokens, "mode": mode, "blocks": args.blocks}
                try:
                    fields, summary = compare(name, tokens, mode == "compile")
                except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"[{who}] {name} {tokens} {mode}: {row['error']}", file=sys.stderr,
                          flush=True)
                else:
                    row.update(fields)
                    print(f"[{who}] {name} {tokens:>6} {mode:<7} {summary}", flush=True)
                rows.append(row)
    return rows


def markdown(rows, columns, cells) -> str:
    """A markdown table: the header ``columns``, then per row ``cells(row)`` (the cells as
    strings) or, for a row with ``error``, its error line."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append(error_line(r, len(columns)) if "error" in r
                     else "| " + " | ".join(cells(r)) + " |")
    return "\n".join(lines) + "\n"


def error_line(row, columns: int) -> str:
    """The table line of a failed row with ``columns`` columns in all."""
    return (f"| {row['model']} | {row['tokens']} | {row['mode']} | error: {row['error']} |"
            + " |" * (columns - 4))
