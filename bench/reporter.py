"""The one reporter of every benchmark (bench/README.md): a header, then markdown tables.

``header()`` -> dict(device, commit, command, date, torch); ``header_lines(title)`` the same as
the markdown lines every result file starts with; ``table(columns, rows)`` a markdown table
(floats with ``digits`` decimals); ``TIMING_COLUMNS`` / ``timing_cells`` the columns of a
``bench.timing.Timing`` (median, min, p90 ms, reps). ``report(title, columns, rows)`` joins
a header and one table. Result files and their names: docs/results.md.

No torch import at module level: the device is read from torch only when it is loaded.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
TIMING_COLUMNS = ("median ms", "min ms", "p90 ms", "reps")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device() -> str:
    """The GPUs torch sees ("NVIDIA H200 x2") or, without CUDA, the CPU and its core count."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{torch.cuda.get_device_name(0)} x{n}"
    return f"CPU: {_cpu_name()}, {os.cpu_count()} cores"


def commit(repo: Path = REPO) -> str:
    """The checkout's commit (short hash, "+dirty" with uncommitted changes) or "unknown"."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command(argv: Optional[Sequence[str]] = None) -> str:
    """The command line as it was typed (``python -m bench.x ...``; torchrun's workers show
    their own), or `argv` quoted."""
    args = list(argv) if argv is not None else list(getattr(sys, "orig_argv", sys.argv))
    if argv is None and args:
        args[0] = os.path.basename(args[0])
    return shlex.join(args)


def header(argv: Optional[Sequence[str]] = None) -> dict:
    """device, commit, command, date (UTC, minutes) and the torch version (or "-")."""
    torch = sys.modules.get("torch")
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"device": device(), "commit": commit(), "command": command(argv),
            "date": now.strftime("%Y-%m-%d %H:%M UTC"),
            "torch": getattr(torch, "__version__", "-")}


def header_lines(title: str, argv: Optional[Sequence[str]] = None) -> list:
    """``# title`` and the header as markdown lines, then a blank line."""
    h = header(argv)
    return [f"# {title}", "", f"- device: {h['device']}", f"- commit: {h['commit']}",
            f"- command: `{h['command']}`", f"- date: {h['date']}", f"- torch: {h['torch']}", ""]


def _cell(v, digits: int) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(columns: Sequence[str], rows: Iterable[Sequence], digits: int = 3) -> str:
    """A markdown table; a row must have one cell per column."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for i, row in enumerate(rows):
        row = list(row)
        if len(row) != len(columns):
            raise ValueError(f"table: row {i} has {len(row)} cells, expected {len(columns)}")
        lines.append("| " + " | ".join(_cell(v, digits) for v in row) + " |")
    return "\n".join(lines) + "\n"


def timing_cells(t) -> list:
    """A bench.timing.Timing as the cells of TIMING_COLUMNS."""
    return [t.median_ms, t.min_ms, t.p90_ms, t.reps]


def report(title: str, columns: Sequence[str], rows: Iterable[Sequence], notes: str = "",
           argv: Optional[Sequence[str]] = None, digits: int = 3) -> str:
    """The header, optional notes, and one table."""
    text = "\n".join(header_lines(title, argv)) + "\n"
    if notes:
        text += notes.rstrip() + "\n\n"
    return text + table(columns, rows, digits)


def write(path, text: str) -> None:
    """Writes a report (its folder created) and says where on stderr."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
