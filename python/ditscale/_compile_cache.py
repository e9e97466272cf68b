"""Keys torch.compile's on-disk caches to this build of ditscale (why: docs/adaln.md).

PyTorch's AOTAutograd and FX-graph caches do not hash custom ops' autograd formulas and fake
kernels (pytorch/pytorch#144344): after an upgrade that changes what a backward saves, a warm
cache would replay the old backward against the new ops, silently. Both caches hash
``torch.compiler.config.cache_key_tag``; :func:`tag_compile_caches` appends
``ditscale-<fingerprint>`` to it (keeping any tag the user set), where::

    fingerprint = sha256(for each .py file of the package, sorted: relative path, bytes;
                         for each compiled library loaded: file name, GNU build-id
                         (or sha256 of the file where it has none))[:16 hex digits]

A user who sets ``cache_key_tag`` after importing ditscale.ops should append to it (or include
:func:`compile_cache_tag`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from typing import Iterable, Optional

_PT_NOTE = 4
_NT_GNU_BUILD_ID = 3
_MAX_PHNUM = 4096  # program headers read at most (a real library has about 10)
_MAX_NOTE_BYTES = 1 << 16  # bytes of one PT_NOTE segment read at most


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _build_id_in_notes(notes: bytes, endian: str) -> Optional[bytes]:
    """The NT_GNU_BUILD_ID descriptor in a PT_NOTE segment's bytes, or None.

    Each note: namesz, descsz, type (u32 each), name (namesz bytes, padded to 4), desc (descsz
    bytes, padded to 4)."""
    pos = 0
    while pos + 12 <= len(notes):
        namesz, descsz, ntype = struct.unpack_from(endian + "III", notes, pos)
        name_at = pos + 12
        desc_at = name_at + _align4(namesz)
        end = desc_at + _align4(descsz)
        if end > len(notes) or end <= pos:
            return None
        if ntype == _NT_GNU_BUILD_ID and notes[name_at:name_at + namesz] == b"GNU\0":
            return notes[desc_at:desc_at + descsz] or None
        pos = end
    return None


def elf_build_id(path: str) -> Optional[bytes]:
    """The GNU build-id of the 64-bit ELF file at ``path`` (the linker's hash of its content),
    or None when the file is not such an ELF file or has no build-id. Reads only the ELF header,
    the program headers and the PT_NOTE segments (each bounded), never the whole file."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] not in (1, 2):
            return None
        endian = "<" if ident[5] == 1 else ">"
        phoff, = struct.unpack_from(endian + "Q", ident, 0x20)
        phentsize, phnum = struct.unpack_from(endian + "HH", ident, 0x36)
        if phentsize < 56 or phnum > _MAX_PHNUM or phoff >= file_size:
            return None
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(len(table) // phentsize):
            at = i * phentsize
            ptype, = struct.unpack_from(endian + "I", table, at)
            if ptype != _PT_NOTE:
                continue
            offset, = struct.unpack_from(endian + "Q", table, at + 8)
            size, = struct.unpack_from(endian + "Q", table, at + 32)
            if offset >= file_size:
                return None
            f.seek(offset)
            found = _build_id_in_notes(f.read(min(size, _MAX_NOTE_BYTES)), endian)
            if found:
                return found
    return None


def _library_identity(path: str) -> bytes:
    build_id = elf_build_id(path)
    if build_id is not None:
        return b"build-id:" + build_id
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return b"sha256:" + h.digest()


def fingerprint(package_dir: str, libraries: Iterable[str]) -> str:
    """16 hex digits that change with any .py file under ``package_dir`` and with any of the
    compiled ``libraries`` (formula in the module's docstring). Same files, same digits."""
    h = hashlib.sha256()
    sources = []
    for root, dirs, files in os.walk(package_dir):
        dirs.sort()
        sources += [os.path.join(root, n) for n in files if n.endswith(".py")]
    for path in sorted(sources):
        h.update(os.path.relpath(path, package_dir).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    for path in sorted(libraries, key=os.path.basename):
        h.update(os.path.basename(path).encode() + b"\0" + _library_identity(path))
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def compile_cache_tag(extension_path: Optional[str] = None) -> str:
    """``ditscale-<fingerprint>`` of this package and its loaded extension ``extension_path``
    (ditscale._C; None where it is not loaded)."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    libraries = [extension_path] if extension_path else []
    return "ditscale-" + fingerprint(package_dir, libraries)


def tag_compile_caches(extension_path: Optional[str] = None) -> str:
    """Appends :func:`compile_cache_tag` to ``torch.compiler.config.cache_key_tag`` (once;
    a tag the user set stays in front). Returns the tag now in force."""
    import torch.compiler.config as compiler_config

    tag = compile_cache_tag(extension_path)
    current = compiler_config.cache_key_tag
    if tag not in current.split(";"):
        compiler_config.cache_key_tag = f"{current};{tag}" if current else tag
    return compiler_config.cache_key_tag
