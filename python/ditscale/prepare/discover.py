"""Inputs of a prepare run and their captions, in the order that assigns the sample ids.

``discover(input)`` takes a folder (media files with sidecar ``.txt`` captions, and WebDataset
``.tar`` shards), a table (``.csv`` / ``.jsonl`` / ``.parquet`` with columns ``path, caption``;
relative paths are relative to the table's folder) or one ``.tar`` shard. It returns the media
items and the entries already known to be bad (no caption, a bad table row, an unreadable tar),
both in input order: sorted relative paths for a folder (a tar's members in their order inside
it), row order for a table. Rules and limits: [docs/prepare.md](../../../docs/prepare.md#inputs).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import tarfile
from typing import Iterator, List, Optional, Tuple

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv")
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")
TABLE_EXTS = (".csv", ".jsonl", ".parquet")
CAPTION_KEYS = ("caption", "text", "prompt")   # of a WebDataset .json member, first found
MAX_CAPTION_BYTES = 1 << 20                     # a caption file or member, [0, 1 MiB]
MAX_ROWS = 100_000_000                          # rows of a table / members of the inputs


@dataclasses.dataclass(frozen=True)
class Item:
    """One media sample: ``path`` is its manifest path (relative to the input folder or as the
    table wrote it; a tar member is TAR/MEMBER); ``file`` the file to read, and for a tar member
    the byte range [offset, offset + size) of it."""
    path: str
    caption: str
    file: str
    is_image: bool
    offset: Optional[int] = None
    size: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Bad:
    path: str
    reason: str


def media_ext(name: str) -> Optional[str]:
    ext = os.path.splitext(name)[1].lower()
    return ext if ext in VIDEO_EXTS + IMAGE_EXTS else None


def _decode_caption(data: bytes) -> Tuple[Optional[str], Optional[str]]:
    """(caption, None) or (None, reason)."""
    if len(data) > MAX_CAPTION_BYTES:
        return None, f"caption of {len(data)} bytes is over the limit of {MAX_CAPTION_BYTES}"
    try:
        return " ".join(data.decode("utf-8").split()), None
    except UnicodeDecodeError as e:
        return None, f"caption is not UTF-8 ({e.reason} at byte {e.start})"


def _sidecar(full: str) -> Tuple[Optional[str], Optional[str]]:
    txt = os.path.splitext(full)[0] + ".txt"
    try:
        with open(txt, "rb") as f:
            return _decode_caption(f.read(MAX_CAPTION_BYTES + 1))
    except FileNotFoundError:
        return None, f"no caption ({os.path.basename(txt)} not found)"
    except OSError as e:
        return None, f"caption unreadable ({e.strerror})"


def _walk(root: str) -> Iterator[str]:
    """Relative paths (with /) of the files under root, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return iter(sorted(found))


def _folder(root: str, items: List[Item], bad: List[Bad]) -> None:
    for rel in _walk(root):
        full = os.path.join(root, rel)
        if rel.lower().endswith(".tar"):
            _tar(full, rel, items, bad)
            continue
        ext = media_ext(rel)
        if ext is None:
            continue
        caption, why = _sidecar(full)
        if why:
            bad.append(Bad(rel, why))
        else:
            items.append(Item(rel, caption, full, ext in IMAGE_EXTS))


def _tar_caption(tf: tarfile.TarFile, member: tarfile.TarInfo) -> Tuple[Optional[str], str]:
    data = tf.extractfile(member).read(MAX_CAPTION_BYTES + 1)
    if member.name.lower().endswith(".txt"):
        return _decode_caption(data)
    try:
        obj = json.loads(data)
    except ValueError as e:
        return None, f"{member.name}: not JSON ({e})"
    for key in CAPTION_KEYS:
        if isinstance(obj, dict) and isinstance(obj.get(key), str):
            return _decode_caption(obj[key].encode())
    return None, f"{member.name}: no string field {' / '.join(CAPTION_KEYS)}"


def _tar(full: str, rel: str, items: List[Item], bad: List[Bad]) -> None:
    """The samples of one WebDataset shard: members grouped by key (the name up to the first
    dot of its basename), one media member and a .txt or .json caption per key."""
    groups: dict = {}
    try:
        with tarfile.open(full, mode="r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                d, b = os.path.split(m.name)
                key = f"{d}/{b.split('.', 1)[0]}"
                g = groups.setdefault(key, {})
                ext = os.path.splitext(m.name)[1].lower()
                if media_ext(m.name):
                    g["media"] = m
                elif ext in (".txt", ".json") and "caption" not in g:
                    g["caption"] = _tar_caption(tf, m)
    except (tarfile.TarError, OSError, EOFError) as e:
        bad.append(Bad(rel, f"unreadable tar ({type(e).__name__}: {e})"))
        return
    for key, g in groups.items():
        if "media" not in g:
            continue
        m = g["media"]
        path = f"{rel}/{m.name}"
        caption, why = g.get("caption", (None, f"no caption member for key {key.lstrip('/')}"))
        if why:
            bad.append(Bad(path, why))
        else:
            items.append(Item(path, caption, full, media_ext(m.name) in IMAGE_EXTS,
                              m.offset_data, m.size))


def _table_rows(path: str) -> Iterator[Tuple[int, object, object, Optional[str]]]:
    """(line, path, caption, what is wrong with the row or None) of each row of a table;
    ValueError naming the file for a table without the columns."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq
        try:
            t = pq.read_table(path, columns=["path", "caption"])
        except (KeyError, ValueError, OSError) as e:
            raise ValueError(f"{path}: cannot read columns path, caption ({e})") from None
        yield from ((i + 1, p, c, None) for i, (p, c) in
                    enumerate(zip(t.column("path").to_pylist(), t.column("caption").to_pylist())))
    elif ext == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            r = csv.DictReader(f)
            if not r.fieldnames or not {"path", "caption"} <= set(r.fieldnames):
                raise ValueError(f"{path}: the header must have columns path and caption")
            yield from ((r.line_num, row["path"], row["caption"], None) for row in r)
    else:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        yield n, None, None, f"not JSON ({e})"
                        continue
                    obj = obj if isinstance(obj, dict) else {}
                    yield n, obj.get("path"), obj.get("caption"), None


def _table(path: str, items: List[Item], bad: List[Bad]) -> None:
    base = os.path.dirname(os.path.abspath(path))
    for n, p, caption, error in _table_rows(path):
        if n > MAX_ROWS + 1:
            raise ValueError(f"{path}: more than {MAX_ROWS} rows")
        if error or not isinstance(p, str) or not p.strip():
            bad.append(Bad(f"{os.path.basename(path)}:{n}", error or "no path"))
            continue
        ext = media_ext(p)
        if not isinstance(caption, str):
            bad.append(Bad(p, "no caption in the table"))
        elif ext is None:
            bad.append(Bad(p, f"not a media file ({', '.join(VIDEO_EXTS + IMAGE_EXTS)})"))
        else:
            cap, why = _decode_caption(caption.encode())
            if why:
                bad.append(Bad(p, why))
            else:
                items.append(Item(p, cap, os.path.join(base, p), ext in IMAGE_EXTS))


def discover(input_path: str) -> Tuple[List[Item], List[Bad]]:
    """(items, bad) of a folder, a table or a .tar shard (see the module docstring)."""
    items: List[Item] = []
    bad: List[Bad] = []
    if os.path.isdir(input_path):
        _folder(input_path, items, bad)
    elif not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input: {input_path}: no such file or folder")
    elif input_path.lower().endswith(".tar"):
        _tar(input_path, os.path.basename(input_path), items, bad)
    elif os.path.splitext(input_path)[1].lower() in TABLE_EXTS:
        _table(input_path, items, bad)
    else:
        raise ValueError(f"--input: {input_path}: expected a folder, a .tar shard or a table "
                         f"({', '.join(TABLE_EXTS)})")
    if len(items) + len(bad) > MAX_ROWS:
        raise ValueError(f"--input: {input_path}: more than {MAX_ROWS} inputs")
    return items, bad
