"""torch.compile's caches are keyed to the build of ditscale (ditscale._compile_cache).

A graph cached by another build must be a cache miss (its backward may call ditscale's ops with
another contract), an unchanged build keeps its hits; the build-id reader is exact on real and
synthetic ELF files and returns None on hostile bytes (bounded fuzz)."""

import os
import random
import shutil
import struct
import subprocess

import pytest
import torch

import ditscale.ops as dops
from ditscale import _compile_cache as cc
from ditscale import _extension

pytestmark = pytest.mark.skipif(not dops.is_available(), reason=str(dops.load_error()))


def _elf(notes: bytes, endian="<") -> bytes:
    """A minimal 64-bit ELF file: header, one PT_LOAD and one PT_NOTE program header, notes."""
    phoff, phentsize, phnum = 64, 56, 2
    notes_at = phoff + phentsize * phnum
    ident = b"\x7fELF" + bytes([2, 1 if endian == "<" else 2, 1]) + bytes(9)
    header = ident + struct.pack(endian + "HHIQQQIHHHHHH", 3, 62, 1, 0, phoff, 0, 0, 64,
                                 phentsize, phnum, 64, 0, 0)
    load = struct.pack(endian + "IIQQQQQQ", 1, 5, 0, 0, 0, notes_at, notes_at, 0x1000)
    note = struct.pack(endian + "IIQQQQQQ", 4, 4, notes_at, notes_at, notes_at, len(notes),
                       len(notes), 4)
    return header + load + note + notes


def _note(ntype: int, name: bytes, desc: bytes, endian="<") -> bytes:
    pad = lambda b: b + bytes(-len(b) % 4)  # noqa: E731
    return struct.pack(endian + "III", len(name), len(desc), ntype) + pad(name) + pad(desc)


@pytest.mark.parametrize("endian", ["<", ">"])
def test_build_id_of_a_synthetic_elf(tmp_path, endian):
    want = bytes(range(20))
    notes = _note(1, b"GNU\0", b"\x01\x02\x03", endian) + _note(3, b"GNU\0", want, endian)
    path = tmp_path / "lib.so"
    path.write_bytes(_elf(notes, endian))
    assert cc.elf_build_id(str(path)) == want
    path.write_bytes(_elf(_note(3, b"XYZ\0", want, endian), endian))  # another owner's note
    assert cc.elf_build_id(str(path)) is None


def test_build_id_of_the_loaded_extension_matches_readelf():
    path = _extension.library_path()
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run([readelf, "-n", path], capture_output=True, text=True, check=True).stdout
    ids = [ln.split(":")[1].strip() for ln in out.splitlines() if "Build ID:" in ln]
    got = cc.elf_build_id(path)
    assert (got.hex() if got else None) == (ids[0] if ids else None)


def test_hostile_bytes_give_no_build_id(tmp_path):
    rng = random.Random(1205)
    base = _elf(_note(3, b"GNU\0", bytes(20)))
    path = tmp_path / "fuzz.so"
    for _ in range(400):  # bounded: truncations, flipped bytes and random files
        data = bytearray(base)
        kind = rng.randrange(3)
        if kind == 0:
            data = data[: rng.randrange(len(data))]
        elif kind == 1:
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            data = bytearray(rng.randbytes(rng.randrange(0, 300)))
        path.write_bytes(bytes(data))
        got = cc.elf_build_id(str(path))
        assert got is None or isinstance(got, bytes)


def test_fingerprint_follows_sources_and_libraries(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "b.py").write_text("B = 2\n")
    lib = tmp_path / "_C.so"
    lib.write_bytes(_elf(_note(3, b"GNU\0", b"\x11" * 20)))
    first = cc.fingerprint(str(pkg), [str(lib)])
    assert first == cc.fingerprint(str(pkg), [str(lib)]) and len(first) == 16
    (pkg / "sub" / "b.py").write_text("B = 3\n")
    second = cc.fingerprint(str(pkg), [str(lib)])
    assert second != first
    lib.write_bytes(_elf(_note(3, b"GNU\0", b"\x22" * 20)))  # a rebuilt extension
    assert cc.fingerprint(str(pkg), [str(lib)]) != second
    lib.write_bytes(b"not an ELF file")  # no build-id: the file's own hash
    assert cc.fingerprint(str(pkg), [str(lib)]) not in (first, second)


def test_importing_the_ops_tags_the_caches_once_keeping_the_users_tag():
    import torch.compiler.config as compiler_config

    tag = cc.compile_cache_tag(_extension.library_path())
    assert tag in compiler_config.cache_key_tag.split(";")
    with compiler_config.patch(cache_key_tag="users-tag"):
        assert cc.tag_compile_caches(_extension.library_path()) == "users-tag;" + tag
        assert cc.tag_compile_caches(_extension.library_path()) == "users-tag;" + tag


def test_another_build_is_a_cache_miss(tmp_path, monkeypatch):
    """The same graph through inductor: a hit under the same tag, a miss under another one."""
    from torch._dynamo.utils import counters
    import torch.compiler.config as compiler_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    x = torch.randn(2, 3, 8, requires_grad=True)
    gate = torch.randn(2, 8, requires_grad=True)
    s, t = torch.randn(2, 8), torch.randn(2, 8)

    def f(x, gate):
        h, y = dops.adaln_gated(x, gate, x.sin(), s, t)
        return (h * y).sum()

    def compile_and_run():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(f, fullgraph=True)(x, gate).backward()
        return dict(counters["aot_autograd"])

    assert compile_and_run().get("autograd_cache_miss") == 1
    assert compile_and_run().get("autograd_cache_hit") == 1
    with compiler_config.patch(cache_key_tag=compiler_config.cache_key_tag + ";another-build"):
        assert compile_and_run().get("autograd_cache_miss") == 1
    torch._dynamo.reset()
