"""What the benchmark dry-run tests share: a bench program run as ``python -m MODULE`` from the
repository root, with the imported ditscale package's parent (the installed one in CI) first on
the path, one thread, and ``--out-dir`` set."""

import os
import subprocess
import sys
from pathlib import Path

import ditscale

REPO = Path(__file__).resolve().parents[2]
PACKAGE_PARENT = str(Path(ditscale.__file__).resolve().parents[1])


def run_bench(module: str, args, out_dir, timeout_s: int = 240):
    """The finished process of ``python -m module --out-dir out_dir *args``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [PACKAGE_PARENT, str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", module, "--out-dir", str(out_dir), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
