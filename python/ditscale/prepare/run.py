"""One prepare run on this rank: discover, probe, plan, encode this rank's shards, and (rank 0)
the manifest, report and store.json once every rank is done.

Probing is split by rank (item i on rank i mod N) and all-gathered; the plan is then the same on
every rank. Shard k is encoded by rank k mod N; a shard whose done marker and sha256 match is
kept (resume); a tmp file is never read. A run into a store started with other inputs or
settings is refused (prepare.json holds the plan's fingerprint). Every collective carries each
rank's error, so a failure on one rank stops all. See [docs/prepare.md](../../../docs/prepare.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, Sequence

import torch
from tqdm import tqdm

from .. import latent_store as ls
from . import encoders, group, report
from .discover import discover
from .options import PrepareOptions
from .plan import Sample, fingerprint, plan_samples, plan_shards
from .shards import Encoders, encode_shards
from .presets import Preset, get_preset
from .probe import probe

PLAN_JSON = "prepare.json"


def prepare(opts: PrepareOptions) -> dict:
    """Runs prepare on this rank (joining torchrun's group, or the caller's); returns the
    report, shard counts and timing (the same on every rank)."""
    rank, world, created = group.setup(opts.timeout_s)
    try:
        return _run(opts, rank, world)
    finally:
        group.teardown(created)


def _error_of(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _bar(opts: PrepareOptions, rank: int, total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="clip", disable=rank != 0 or not opts.progress,
                file=sys.stderr, dynamic_ncols=True)


def _probe_all(items, opts, rank: int, world: int) -> list:
    mine, error = [], None
    with _bar(opts, rank, len(items[rank::world]), "probe") as bar:
        try:
            for item in items[rank::world]:
                mine.append(probe(item))
                bar.update(1)
        except Exception as e:  # noqa: BLE001 (any failure is carried to every rank)
            error = _error_of(e)
    parts = group.gather(world, mine, error)
    return [parts[i % world][i // world] for i in range(len(items))]


def _shape_model(store: str, preset: Preset) -> str:
    """The train_shape model argument; writes the store's model.json (same bytes on every
    rank) when the preset has no C++ preset."""
    if preset.model_file is None:
        return preset.shape_model
    path = os.path.join(store, preset.shape_model)
    ls._atomic_write_bytes(path, ls._json_bytes(preset.model_file))
    return path


def _settings(opts: PrepareOptions, preset: Preset) -> dict:
    def source(folder):
        return os.path.abspath(folder) if folder else f"random:{preset.name}"
    return dict(format=ls.FORMAT, version=ls.VERSION, model=preset.name,
                shard_size=opts.shard_size, vae=source(opts.vae),
                text_encoder=source(opts.text_encoder), dtype=opts.dtype,
                vae_dtype=opts.vae_dtype,
                device=opts.device, seed=opts.seed if not (opts.vae and opts.text_encoder)
                else None)


def _check_resume(store: str, fp: str, rank: int, world: int) -> None:
    path = os.path.join(store, PLAN_JSON)
    if len(set(group.gather(world, fp))) > 1:
        raise ValueError("--input: the ranks found different inputs (files changing while "
                         "they were read?)")
    error = None
    if os.path.isfile(path):
        with open(path) as f:
            try:
                old = json.load(f).get("fingerprint")
            except ValueError:
                old = None
        if old != fp:
            error = (f"--out: {store} was started with other inputs or settings ({PLAN_JSON}"
                     " differs); use another --out, or remove it to start over")
    group.gather(world, None, error)
    if rank == 0 and not os.path.isfile(path):
        ls._atomic_write_bytes(path, ls._json_bytes({"fingerprint": fp}))
    group.barrier(world)


def _device(opts: PrepareOptions) -> torch.device:
    if opts.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device: cuda is not available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _encode(store, samples, shards, opts, preset, rank: int, world: int):
    """Every shard's ShardInfo (in order), shards kept from before, samples encoded (all
    ranks), and the longest time a rank spent encoding."""
    mine = [s for s in shards if s[0] % world == rank]
    result, error = ({}, 0, 0, 0.0), None
    with _bar(opts, rank, 0, "encode") as bar:
        try:
            result = encode_shards(store, samples, mine,
                                   lambda: Encoders(preset, opts, _device(opts)), bar)
        except Exception as e:  # noqa: BLE001 (any failure is carried to every rank)
            error = _error_of(e)
    parts = group.gather(world, result, error)
    infos: Dict[int, ls.ShardInfo] = {}
    for part in parts:
        infos.update(part[0])
    return ([infos[k] for k, _, _ in shards], sum(p[1] for p in parts),
            sum(p[2] for p in parts), max(p[3] for p in parts))


def _finish(store: str, preset: Preset, opts, samples: Sequence[Sample], infos, rep: dict):
    """Rank 0: manifest, report, then store.json (last: it marks the store finished)."""
    report.write_manifest(store, samples)
    report.write_report(store, rep["inputs"], rep["good"], rep["bad_list"])
    settings = _settings(opts, preset)
    meta = ls.StoreMeta(
        model=preset.name, latent_channels=encoders.vae_channels(preset, opts.vae),
        vae_stride=(4, 8, 8), patch=preset.patch(), text_dim=preset.text_dim(),
        max_text_tokens=preset.max_text_tokens, fps=preset.fps, num_samples=len(samples),
        shards=tuple(infos), vae=settings["vae"], text_encoder=settings["text_encoder"],
        shape_model=preset.shape_model, seed=opts.seed)
    ls.write_store_json(store, meta)


def _run(opts: PrepareOptions, rank: int, world: int) -> dict:
    start = time.monotonic()
    preset = get_preset(opts.model)
    store = os.path.abspath(opts.out)
    os.makedirs(os.path.join(store, ls.SHARD_DIR), exist_ok=True)
    shape_model = _shape_model(store, preset)
    items, bad = discover(opts.input)
    samples, probe_bad = plan_samples(items, _probe_all(items, opts, rank, world), shape_model)
    bad = bad + probe_bad
    shards = plan_shards(len(samples), opts.shard_size)
    _check_resume(store, fingerprint(samples, **_settings(opts, preset)), rank, world)
    infos, reused, encoded, encode_s = _encode(store, samples, shards, opts, preset, rank,
                                               world)
    rep = {"inputs": len(items) + len(bad) - len(probe_bad), "good": len(samples),
           "bad_list": bad}
    error = None
    if rank == 0:
        try:
            _finish(store, preset, opts, samples, infos, rep)
        except Exception as e:  # noqa: BLE001 (carried to every rank)
            error = _error_of(e)
    group.gather(world, None, error)
    seconds = time.monotonic() - start
    out = {"store": store, "inputs": rep["inputs"], "good": len(samples), "bad": len(bad),
           "shards": len(shards), "reused": reused, "encoded": encoded,
           "encode_seconds": encode_s, "seconds": seconds}
    if rank == 0:
        print(report.summary(out), flush=True)
    return out
