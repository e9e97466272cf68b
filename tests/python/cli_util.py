"""Finding the built `ditscale` CLI for the tests that run it.

`$DITSCALE_CLI` (tools/run_tests.sh sets it to build/tools/ditscale) is used when set, and must be
a working binary with the asked-for feature: CI never skips these tests silently. Without it, the
newest `build*/tools/ditscale` of the checkout that has the feature (another build may be linking
its binary right now), else None (the test module then skips)."""
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _has(binary, probe, marker):
    try:
        r = subprocess.run([binary, *probe, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and marker in r.stdout


def find_cli(probe, marker):
    """A ditscale binary whose `<probe> --help` exits 0 and mentions `marker`, or None."""
    env = os.environ.get("DITSCALE_CLI")
    if env:
        if not _has(env, probe, marker):
            raise RuntimeError(f"DITSCALE_CLI={env}: `{' '.join(probe)} --help` does not offer "
                               f"{marker} (rebuild the CLI)")
        return env
    cands = [shutil.which("ditscale")]
    cands += [str(p) for p in sorted(REPO.glob("build*/tools/ditscale"),
                                     key=lambda p: p.stat().st_mtime, reverse=True)]
    return next((c for c in cands if c and _has(c, probe, marker)), None)
