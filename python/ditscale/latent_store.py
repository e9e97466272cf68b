"""The latent store: VAE latents and text embeddings of a corpus, written by ``ditscale.prepare``.

Layout, fields and their ranges: [docs/prepare.md](../../docs/prepare.md#the-latent-store).
Reader (the trainer's map-style dataset)::

    store = LatentStore("store")                 # validates store.json, every shard present
    store.check_model(latent_channels=16, patch=(1, 2, 2), text_dim=4096)
    sample = store[i]     # {"latent": [C, F', H', W'] bf16, "text": [L_i, text_dim] bf16, "id": i}

Shards are opened lazily with safetensors' ``safe_open`` and cached per process (DataLoader
workers each open their own). Writer helpers (used by ``ditscale.prepare``): ``write_shard``
(tmp file + rename, then a done marker with its sha256), ``finished_shard`` (a shard that need
not be redone), ``write_store_json`` (last, atomic).
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import hashlib
import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ._checks import INT64_MAX, check_int, check_real

FORMAT = "ditscale-latent-store"
VERSION = 1
STORE_JSON = "store.json"
MANIFEST_CSV = "manifest.csv"
SHARD_DIR = "shards"
MAX_SAMPLES = 1_000_000_000     # num_samples range [0, MAX_SAMPLES]
MAX_SHARD_SAMPLES = 1 << 20     # a shard's count range [1, MAX_SHARD_SAMPLES]
MAX_LATENT_CHANNELS = 4096
MAX_TEXT_DIM = 65536
MAX_TEXT_TOKENS = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHARD_FILE = re.compile(r"shards/[0-9]{5,9}\.safetensors")


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Shard ``file`` (relative to the store) holds ids [first_id, first_id + count)."""
    file: str
    first_id: int
    count: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class StoreMeta:
    """The parsed store.json (field meanings and ranges: docs/prepare.md)."""
    model: str
    latent_channels: int
    vae_stride: Tuple[int, int, int]
    patch: Tuple[int, int, int]
    text_dim: int
    max_text_tokens: int
    fps: float
    num_samples: int
    shards: Tuple[ShardInfo, ...]
    vae: str
    text_encoder: str
    # The ``model`` argument of ditscale._core.train_shape / BalancedBatchSampler that maps the
    # manifest to the shapes the latents were made at: a C++ preset name, or a JSON model file
    # relative to the store (LatentStore.shape_model resolves it).
    shape_model: str
    latent_dtype: str = "bfloat16"
    text_dtype: str = "bfloat16"
    # The seed of the random weights where vae / text_encoder is "random:<preset>" (optional in
    # store.json: 0 when absent).
    seed: int = 0
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> dict:
        d = {"format": self.format, "version": self.version, **dataclasses.asdict(self)}
        d["vae_stride"], d["patch"] = list(self.vae_stride), list(self.patch)
        d["shards"] = [dataclasses.asdict(s) for s in self.shards]
        return d


def latent_shape(meta: StoreMeta, frames: int, height: int, width: int) -> Tuple[int, ...]:
    """[C, F', H', W'] of a sample whose training shape (train_shape) is frames x height x width
    pixels: F' = (frames - 1) / vae_t + 1, H' = height / vae_h, W' = width / vae_w."""
    t, h, w = meta.vae_stride
    return (meta.latent_channels, (frames - 1) // t + 1, height // h, width // w)


def shard_file(index: int) -> str:
    """Relative path of shard ``index``: shards/NNNNN.safetensors."""
    check_int("shard index", index, 0, MAX_SAMPLES)
    return f"{SHARD_DIR}/{index:05d}.safetensors"


def _done_marker(store: str, index: int) -> str:
    return os.path.join(store, SHARD_DIR, f"{index:05d}.done.json")


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


# ---- writer -------------------------------------------------------------------------------------

def write_shard(store: str, index: int, first_id: int,
                samples: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> ShardInfo:
    """Writes shard ``index`` holding ids first_id.. (one (latent, text) pair each, cast to bf16)
    under a tmp name, renames it, then writes its done marker. Returns its ShardInfo."""
    from safetensors.torch import save_file

    check_int("count", len(samples), 1, MAX_SHARD_SAMPLES)
    tensors: Dict[str, torch.Tensor] = {}
    for k, (latent, text) in enumerate(samples):
        tensors[f"{first_id + k}.latent"] = latent.detach().to("cpu", torch.bfloat16).contiguous()
        tensors[f"{first_id + k}.text"] = text.detach().to("cpu", torch.bfloat16).contiguous()
    rel = shard_file(index)
    path = os.path.join(store, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    marker = _done_marker(store, index)
    for stale in glob.glob(glob.escape(path) + ".tmp.*") + glob.glob(glob.escape(marker) +
                                                                     ".tmp.*"):
        os.remove(stale)   # of an interrupted run: never read
    tmp = f"{path}.tmp.{os.getpid()}"
    save_file(tensors, tmp)   # no metadata: safetensors writes its keys in hash order
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    info = ShardInfo(rel, int(first_id), len(samples), sha256_of(path))
    _atomic_write_bytes(marker, _json_bytes(dataclasses.asdict(info)))
    return info


def finished_shard(store: str, index: int, first_id: int, count: int) -> Optional[ShardInfo]:
    """The ShardInfo of shard ``index`` if its done marker records (first_id, count) and its file
    exists with the recorded sha256; else None (the shard must be (re)written)."""
    try:
        with open(_done_marker(store, index)) as f:
            d = json.load(f)
        info = ShardInfo(str(d["file"]), int(d["first_id"]), int(d["count"]), str(d["sha256"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (info.file, info.first_id, info.count) != (shard_file(index), first_id, count):
        return None
    path = os.path.join(store, info.file)
    if not os.path.isfile(path) or sha256_of(path) != info.sha256:
        return None
    return info


def write_store_json(store: str, meta: StoreMeta) -> None:
    """Writes store.json atomically (tmp + rename): the last file a finished store gets."""
    _atomic_write_bytes(os.path.join(store, STORE_JSON), _json_bytes(meta.to_json()))


# ---- parsing store.json -------------------------------------------------------------------------

def _as_value_error(check, name: str, value, lo, hi):
    """check(name, value, lo, hi), a wrong type in the file being a ValueError too."""
    try:
        return check(name, value, lo, hi)
    except TypeError as e:
        raise ValueError(str(e)) from None


class _Fields:
    """Typed, range-checked fields of one JSON object; errors name the file and the field."""

    def __init__(self, where: str, d):
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        self.where, self.d = where, d

    def get(self, name: str):
        if name not in self.d:
            raise ValueError(f"{self.where}: missing field {name!r}")
        return self.d[name]

    def int(self, name: str, lo: int, hi: int) -> int:
        return _as_value_error(check_int, f"{self.where}: {name}", self.get(name), lo, hi)

    def str(self, name: str, choices: Optional[Sequence[str]] = None) -> str:
        v = self.get(name)
        if not isinstance(v, str) or not v:
            raise ValueError(f"{self.where}: {name}: expected a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise ValueError(f"{self.where}: {name}: {v!r} is not one of {', '.join(choices)}")
        return v

    def triple(self, name: str, lo: int, hi: int) -> Tuple[int, int, int]:
        v = self.get(name)
        if not isinstance(v, list) or len(v) != 3:
            raise ValueError(f"{self.where}: {name}: expected [t, h, w], got {v!r}")
        return tuple(_as_value_error(check_int, f"{self.where}: {name}[{k}]", x, lo, hi)
                     for k, x in enumerate(v))


def _parse_shards(f: _Fields, num_samples: int) -> Tuple[ShardInfo, ...]:
    raw = f.get("shards")
    if not isinstance(raw, list):
        raise ValueError(f"{f.where}: shards: expected a list")
    shards: List[ShardInfo] = []
    next_id = 0
    for k, s in enumerate(raw):
        g = _Fields(f"{f.where}: shards[{k}]", s)
        file = g.str("file")
        if not _SHARD_FILE.fullmatch(file):
            raise ValueError(f"{g.where}: file: {file!r} is not shards/NNNNN.safetensors")
        first = g.int("first_id", next_id, next_id)   # shards tile the ids in order
        count = g.int("count", 1, MAX_SHARD_SAMPLES)
        sha = g.str("sha256")
        if not _SHA256.fullmatch(sha):
            raise ValueError(f"{g.where}: sha256: {sha!r} is not 64 lowercase hex digits")
        shards.append(ShardInfo(file, first, count, sha))
        next_id = first + count
    if next_id != num_samples:
        raise ValueError(f"{f.where}: shards hold {next_id} samples, num_samples is {num_samples}")
    return tuple(shards)


def parse_store_json(path: str) -> StoreMeta:
    """StoreMeta of the store.json at ``path``; ValueError naming the file and field."""
    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    f = _Fields(path, d)
    f.str("format", (FORMAT,))
    f.int("version", VERSION, VERSION)
    num = f.int("num_samples", 0, MAX_SAMPLES)
    fps = f.get("fps")
    return StoreMeta(
        model=f.str("model"), latent_channels=f.int("latent_channels", 1, MAX_LATENT_CHANNELS),
        vae_stride=f.triple("vae_stride", 1, 64), patch=f.triple("patch", 1, 64),
        text_dim=f.int("text_dim", 1, MAX_TEXT_DIM),
        max_text_tokens=f.int("max_text_tokens", 1, MAX_TEXT_TOKENS),
        fps=_as_value_error(check_real, f"{path}: fps", fps, 0, 1000), num_samples=num,
        shards=_parse_shards(f, num), vae=f.str("vae"), text_encoder=f.str("text_encoder"),
        shape_model=f.str("shape_model"), latent_dtype=f.str("latent_dtype", ("bfloat16",)),
        text_dtype=f.str("text_dtype", ("bfloat16",)),
        seed=f.int("seed", 0, INT64_MAX) if "seed" in d else 0)


# ---- reader -------------------------------------------------------------------------------------

class LatentStore:
    """Random access by sample id to a finished store (see the module docstring).

    ``verify=True`` also checks every shard's sha256 (reads every byte: slow on a big store).
    Errors: FileNotFoundError for a missing or unfinished store (no store.json) or a missing
    shard, ValueError for a field out of range or a shard that does not hold what it should;
    each names the store path and the field or shard.
    """

    def __init__(self, path: str, verify: bool = False):
        self.path = os.path.abspath(path)
        meta_path = os.path.join(self.path, STORE_JSON)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"{self.path}: no such latent store folder")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{self.path}: no {STORE_JSON}: not a latent store, or an "
                                    "unfinished one (run ditscale.prepare again to finish it)")
        self.meta = parse_store_json(meta_path)
        self.manifest_path = os.path.join(self.path, MANIFEST_CSV)
        if not os.path.isfile(self.manifest_path):
            raise FileNotFoundError(f"{self.path}: missing {MANIFEST_CSV}")
        for s in self.meta.shards:
            p = os.path.join(self.path, s.file)
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{self.path}: missing shard {s.file} "
                                        f"(ids {s.first_id}..{s.first_id + s.count - 1})")
            if verify and sha256_of(p) != s.sha256:
                raise ValueError(f"{self.path}: shard {s.file}: sha256 differs from store.json")
        self._firsts = [s.first_id for s in self.meta.shards]
        self._open: Dict[int, object] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.meta.num_samples

    def __getstate__(self) -> dict:
        """Pickled without its open shards (DataLoader workers started by spawn open their own)."""
        state = self.__dict__.copy()
        state["_open"] = {}
        return state

    @property
    def shape_model(self) -> str:
        """The ``model`` argument for ditscale._core.train_shape, BalancedBatchSampler and
        ``ditscale plan --model``: a C++ preset name, or the absolute path of the store's JSON
        model file."""
        m = self.meta.shape_model
        local = os.path.join(self.path, m)
        return local if m.endswith(".json") and os.path.isfile(local) else m

    def check_model(self, latent_channels: Optional[int] = None,
                    patch: Optional[Sequence[int]] = None,
                    text_dim: Optional[int] = None) -> None:
        """ValueError naming the store and each field where it differs from the model's."""
        m = self.meta
        diffs = []
        if latent_channels is not None and int(latent_channels) != m.latent_channels:
            diffs.append(f"latent_channels {m.latent_channels} (the model has {latent_channels})")
        if patch is not None and tuple(int(p) for p in patch) != m.patch:
            diffs.append(f"patch {list(m.patch)} (the model has {list(patch)})")
        if text_dim is not None and int(text_dim) != m.text_dim:
            diffs.append(f"text_dim {m.text_dim} (the model has {text_dim})")
        if diffs:
            raise ValueError(f"{self.path}: the latent store was made for model {m.model!r}, "
                             f"not this one: " + "; ".join(diffs))

    def shard_of(self, i: int) -> int:
        """Index of the shard holding sample id ``i``."""
        return bisect.bisect_right(self._firsts, i) - 1

    def _handle(self, k: int):
        from safetensors import safe_open

        if self._pid != os.getpid():          # a forked DataLoader worker: open its own
            self._open, self._pid = {}, os.getpid()
        h = self._open.get(k)
        if h is None:
            file = self.meta.shards[k].file
            try:
                h = safe_open(os.path.join(self.path, file), framework="pt")
            except Exception as e:  # safetensors' own error type for a damaged header
                raise ValueError(f"{self.path}: shard {file} is not a safetensors file: "
                                 f"{e}") from None
            self._open[k] = h
        return h

    def __getitem__(self, i) -> dict:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample id {i!r} is out of range [0, {len(self) - 1}]")
        k = self.shard_of(i)
        h = self._handle(k)
        try:
            latent, text = h.get_tensor(f"{i}.latent"), h.get_tensor(f"{i}.text")
        except Exception as e:  # safetensors raises its own error type for a missing key
            raise ValueError(f"{self.path}: shard {self.meta.shards[k].file} lacks sample {i}: "
                             f"{e}") from None
        self._check_sample(i, k, latent, text)
        return {"latent": latent, "text": text, "id": i}

    def _check_sample(self, i: int, k: int, latent: torch.Tensor, text: torch.Tensor) -> None:
        m = self.meta
        ok = (latent.dtype == torch.bfloat16 and latent.dim() == 4
              and latent.shape[0] == m.latent_channels and text.dtype == torch.bfloat16
              and text.dim() == 2 and text.shape[1] == m.text_dim
              and 1 <= text.shape[0] <= m.max_text_tokens)
        if not ok:
            raise ValueError(
                f"{self.path}: shard {m.shards[k].file}: sample {i} has latent "
                f"{latent.dtype} {list(latent.shape)} and text {text.dtype} {list(text.shape)}; "
                f"expected bf16 [{m.latent_channels}, F, H, W] and bf16 "
                f"[1..{m.max_text_tokens}, {m.text_dim}]")
