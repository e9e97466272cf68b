#!/usr/bin/env python3
"""Does a source change leave the kernels' machine code alone? SASS of two trees, per kernel.

Compiles each given .cu file of an old tree (default: `git archive <ref>` of this repository) and
of the new tree (default: this checkout) to an sm_90a cubin with the flags the CMake build uses
(ditscale/kernels, -O3 -lineinfo -std=c++20), then compares per function (every template
instantiation): the `cuobjdump -sass` instruction streams, with the addresses in comments
dropped and the anonymous namespace's per-path hash in symbols normalised (the instruction text
and its 128-bit encoding, scheduling bits included, are kept), and the `cuobjdump -res-usage`
lines (registers, stack, shared, ...). A one-question probe (lab/README.md), not part of the
build; needs nvcc and cuobjdump, no GPU.

    python3 lab/probes/sass_diff.py ditscale/kernels/adaln.cu ditscale/kernels/attn_merge.cu
    python3 lab/probes/sass_diff.py --old-ref main --arch sm_90a FILE...   # exits 1 on a difference
    python3 lab/probes/sass_diff.py --objects OLD.o NEW.o     # two built objects (or cubins)
"""
import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CUDA_BIN = Path(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc").resolve().parent


def tool(name: str) -> str:
    """NAME from the CUDA toolkit, else from PATH, else the copy Triton ships (cuobjdump)."""
    for cand in (CUDA_BIN / name, shutil.which(name)):
        if cand and Path(cand).exists():
            return str(cand)
    import importlib.util  # pylint: disable=import-outside-toplevel
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        cand = Path(spec.origin).parent / "backends/nvidia/bin" / name
        if cand.exists():
            return str(cand)
    raise SystemExit(f"{name} not found (CUDA toolkit, PATH or triton)")
FLAGS = ["-DFMT_SHARED", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-lineinfo",
         "-std=c++20", "-x", "cu"]
_ADDR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_RES = re.compile(r"^\s*Function (\S+):\s*(.*)$")
# An anonymous namespace's symbol carries a hash of the file's path: the only name normalised.
_ANON = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}")
ANON_NAME = "12_GLOBAL__N_0"  # the normalised namespace (a valid mangled name: demangles too)


def compile_cubin(root: Path, src: str, arch: str, out: Path) -> None:
    """nvcc SRC of tree ROOT -> OUT (a cubin for ARCH), with the build's flags."""
    code = arch.replace("sm_", "compute_")
    cmd = [tool("nvcc"), *FLAGS, f"-I{root}", f"-gencode=arch={code},code={arch}", "-cubin",
           "-o", str(out), str(root / src)]
    subprocess.run(cmd, check=True)


def sass_by_function(cubin: Path) -> dict:
    """{function symbol: [normalised SASS lines]} of a cubin."""
    text = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    funcs, cur = {}, None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(_ANON.sub(ANON_NAME, m.group(1)), [])
            continue
        if cur is None or not line.strip() or ".headerflags" in line:
            continue
        cur.append(_ANON.sub(ANON_NAME, " ".join(_ADDR.sub("", line).split())))
    return funcs


def res_usage(cubin: Path) -> dict:
    """{function symbol: 'REG:.. STACK:.. SHARED:.. ...'} of a cubin."""
    text = subprocess.run([tool("cuobjdump"), "-res-usage", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    lines = text.splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = _RES.match(line)
        if m and i + 1 < len(lines):
            out[_ANON.sub(ANON_NAME, m.group(1))] = " ".join(lines[i + 1].split())
    return out


def demangle(names: list) -> dict:
    """{symbol: demangled name} (c++filt when present)."""
    filt = shutil.which("c++filt")
    if filt is None:
        return {n: n for n in names}
    res = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, res))


def compare(src: str, old: Path, new: Path, show: int) -> bool:
    """Print one line per function of SRC's cubins; True when every function is identical."""
    old_s, new_s = sass_by_function(old), sass_by_function(new)
    old_r, new_r = res_usage(old), res_usage(new)
    names = sorted(set(old_s) | set(new_s))
    pretty = demangle(names)
    same = True
    print(f"== {src}: {len(names)} functions")
    for name in names:
        a, b = old_s.get(name), new_s.get(name)
        label = pretty[name].replace("ditscale::kernels::", "")
        label = label.replace("(anonymous namespace)::", "")
        label = label[:label.rfind("(")] if label.endswith(")") else label
        if a is None or b is None:
            print(f"  MISSING in {'old' if a is None else 'new'}: {label}")
            same = False
            continue
        ra, rb = old_r.get(name, "?"), new_r.get(name, "?")
        if a == b and ra == rb:
            print(f"  identical ({len(a) // 2} instr, {rb}): {label}")
            continue
        same = False
        diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0)
                if d[:1] in "+-" and d[:3] not in ("+++", "---")]
        print(f"  DIFFERS: {len(diff)} lines differ ({len(a) // 2} -> {len(b) // 2} instr); "
              f"res old [{ra}] new [{rb}]: {label}")
        for d in diff[:show]:
            print("     ", d)
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help=".cu files, relative to the repository root "
                    "(with --objects: the old and the new object file)")
    ap.add_argument("--objects", action="store_true", help="compare two built objects / cubins")
    ap.add_argument("--old-ref", default="main", help="git ref of the old tree (default main)")
    ap.add_argument("--old-root", type=Path, help="an old tree on disk instead of --old-ref")
    ap.add_argument("--new-root", type=Path, default=REPO, help="the new tree (this checkout)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--show", type=int, default=20, help="differing lines printed per function")
    ap.add_argument("--old-cache", type=Path, help="keep / reuse the old tree's cubins here")
    args = ap.parse_args()
    if args.objects:
        if len(args.files) != 2:
            ap.error("--objects takes OLD NEW")
        ok = compare(args.files[1], Path(args.files[0]), Path(args.files[1]), args.show)
        print("ALL IDENTICAL" if ok else "SASS DIFFERS")
        return 0 if ok else 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        old_root = args.old_root
        if old_root is None:
            old_root = tmp / "old"
            old_root.mkdir()
            tar = subprocess.run(["git", "-C", str(REPO), "archive", args.old_ref], check=True,
                                 capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old_root)], input=tar, check=True)
        ok = True
        for i, src in enumerate(args.files):
            old, new = tmp / f"old{i}.cubin", tmp / f"new{i}.cubin"
            if args.old_cache is not None:
                args.old_cache.mkdir(parents=True, exist_ok=True)
                old = args.old_cache / (src.replace("/", "_") + f".{args.arch}.cubin")
            if not old.exists():
                compile_cubin(old_root, src, args.arch, old)
            compile_cubin(args.new_root.resolve(), src, args.arch, new)
            ok = compare(src, old, new, args.show) and ok
    print("ALL IDENTICAL" if ok else "SASS DIFFERS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
