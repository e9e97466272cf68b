"""Checkpoints of a run: ``OUT/checkpoints/step-NNNNNNNNN/`` written atomically, the last K kept.

A checkpoint folder holds
    dcp/               torch.distributed.checkpoint of {"model", "optim", "ema"} (sharded DTensors:
                       loads on any world size)
    rng-R.pt           rank R's torch (and CUDA) RNG states
    train_state.pt     rank 0: step, epoch, the segment's (data-parallel) world size, excluded
                       ids and sampler state, the scheduler's state, the consumed ids of the epoch
    meta.json          rank 0, written last: format, step, world size, sp_degree, the model's
                       description
It is written under ``.tmp-step-N`` and renamed by rank 0 once every rank has finished (a crash
while saving leaves a ``.tmp-*`` folder that is ignored and removed by the next save); then the
oldest beyond ``keep`` are removed. A checkpoint of another model (meta.json's description) is
refused with the fields that differ. See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

FORMAT = "ditscale-train-checkpoint"
_NAME = re.compile(r"^step-(\d{9})$")


def folder_of(out: str) -> str:
    return os.path.join(out, "checkpoints")


def list_checkpoints(out: str) -> List[str]:
    """Finished checkpoints of the run folder ``out``, oldest first."""
    root = folder_of(out)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _NAME.match(n)
                   and os.path.isfile(os.path.join(root, n, "meta.json")))
    return [os.path.join(root, n) for n in names]


def latest(out: str) -> Optional[str]:
    found = list_checkpoints(out)
    return found[-1] if found else None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_state(model, optimizer, ema) -> Dict:
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def rng_state() -> Dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(out: str, step: int, model, optimizer, ema, train_state: Dict, meta: Dict,
         keep: int) -> str:
    """Every rank calls it; returns the checkpoint folder (see the module)."""
    rank = dist.get_rank()
    root = folder_of(out)
    final = os.path.join(root, f"step-{step:09d}")
    tmp = os.path.join(root, f".tmp-step-{step:09d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(_tensor_state(model, optimizer, ema), checkpoint_id=os.path.join(tmp, "dcp"))
    torch.save(rng_state(), os.path.join(tmp, f"rng-{rank}.pt"))
    dist.barrier()
    if rank == 0:
        torch.save(train_state, os.path.join(tmp, "train_state.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"format": FORMAT, "step": step, **meta}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def read_meta(folder: str, model_desc: Dict) -> Dict:
    """meta.json of ``folder``, refused (ValueError) when it is not a checkpoint of this model."""
    path = os.path.join(folder, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {folder!r}: cannot read meta.json ({e}); not a finished "
                         f"checkpoint") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {folder!r}: meta.json is not a {FORMAT}")
    theirs = meta.get("model", {})
    diff = [f"{k} {theirs.get(k)!r} (run: {v!r})" for k, v in model_desc.items()
            if theirs.get(k) != v]
    if diff:
        raise ValueError(f"checkpoint {folder!r} is of another model: {', '.join(diff)}")
    return meta


def load(folder: str, model, optimizer, ema) -> Dict:
    """Loads the tensors (resharded to this world size) and this rank's RNG state (when the
    checkpoint has one for it); returns train_state. Call ``read_meta`` first."""
    state = _tensor_state(model, optimizer, ema)
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    if ema is not None and not meta.get("ema"):
        raise ValueError(f"checkpoint {folder!r} has no EMA; the run has ema_decay > 0 "
                         f"(set it to 0, or start a new run)")
    dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    rng_path = os.path.join(folder, f"rng-{dist.get_rank()}.pt")
    if os.path.isfile(rng_path):
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return torch.load(os.path.join(folder, "train_state.pt"), weights_only=False)
