"""A learnable toy latent store for the ``ditscale.train`` tests, and a torchrun launcher.

``make_toy_store(folder, n)``: ``n`` samples of mixed shapes (images and 5- / 9-frame clips at
64x64, 64x128, 128x64 pixels through a small JSON shape model), written with the store's own
writer (``ditscale.latent_store``). Each sample has a class c in 0..3: its text embedding is the
class's fixed random rows, its latent a fixed per-class pattern (channel offsets and a smooth
spatial wave) plus small noise, so a model can learn the latent from the text: the
flow-matching loss falls. Latent channels 4, text width 16: the ``tiny`` preset's
transformer (``ditscale.train``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ditscale import latent_store as ls

REPO = Path(__file__).resolve().parents[2]
SHAPE_MODEL = ('{"base": "wan2.1-1.3b", "max_frames": 9, "target_fps": 16, '
               '"buckets": [[64, 64], [64, 128], [128, 64]]}')
SIZES = [(64, 64), (64, 128), (128, 64)]
CHANNELS, TEXT_DIM, TEXT_TOKENS = 4, 16, 8


def _latent(cls: int, shape, g: torch.Generator) -> torch.Tensor:
    c, f, h, w = shape
    base = torch.Generator().manual_seed(1000 + cls)
    offset = torch.randn(c, 1, 1, 1, generator=base)
    yy = torch.arange(h).view(1, 1, h, 1) / h
    xx = torch.arange(w).view(1, 1, 1, w) / w
    wave = torch.sin(6.28 * (yy * (cls + 1) + xx * (3 - cls))).expand(c, f, h, w)
    return offset + 0.5 * wave + 0.05 * torch.randn(shape, generator=g)


def make_toy_store(folder, n: int = 24, shard_size: int = 8, channels: int = CHANNELS,
                   text_dim: int = TEXT_DIM, model: str = "tiny") -> str:
    """The toy store (see the module); returns its path."""
    import ditscale

    store = str(folder)
    os.makedirs(store, exist_ok=True)
    with open(os.path.join(store, "shape_model.json"), "w") as f:
        f.write(SHAPE_MODEL)
    rows, samples = ["path,num_frames,height,width,fps,caption"], []
    g = torch.Generator().manual_seed(7)
    table = torch.randn(4, TEXT_TOKENS, text_dim, generator=torch.Generator().manual_seed(3))
    for i in range(n):
        cls, (h, w), frames = i % 4, SIZES[(i // 4) % 3], (1, 5, 9)[(i // 2) % 3]
        fps = "" if frames == 1 else "16"
        rows.append(f"s{i}.{'png' if frames == 1 else 'mp4'},{frames},{h},{w},{fps},class {cls}")
        t = ditscale.train_shape(frames, h, w, float(fps or 0), os.path.join(store,
                                                                        "shape_model.json"))
        shape = (channels, (t["frames"] - 1) // 4 + 1, t["height"] // 8, t["width"] // 8)
        samples.append((_latent(cls, shape, g), table[cls, : 3 + cls]))
    with open(os.path.join(store, ls.MANIFEST_CSV), "w") as f:
        f.write("\n".join(rows) + "\n")
    shards = [ls.write_shard(store, k, first, samples[first: first + shard_size])
              for k, first in enumerate(range(0, n, shard_size))]
    ls.write_store_json(store, ls.StoreMeta(
        model=model, latent_channels=channels, vae_stride=(4, 8, 8), patch=(1, 2, 2),
        text_dim=text_dim, max_text_tokens=TEXT_TOKENS, fps=16.0, num_samples=n,
        shards=tuple(shards), vae="random:tiny", text_encoder="random:tiny",
        shape_model="shape_model.json"))
    return store


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return e


def train_cmd(nproc: int, args) -> list:
    """The command that runs ``python -m ditscale.train`` on ``nproc`` CPU ranks."""
    if nproc == 1:
        return [sys.executable, "-m", "ditscale.train", *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "ditscale.train", *map(str, args)]


def run_train(nproc: int, args, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(nproc, args), env=env(), capture_output=True, text=True,
                          timeout=timeout_s)


def run_train_machines(machines: int, per_machine: int, args,
                       timeout_s: float = 240) -> subprocess.CompletedProcess:
    """``python -m ditscale.train`` on ``machines`` emulated machines of ``per_machine`` CPU ranks:
    one torchrun agent per machine (static rendezvous on 127.0.0.1), each with its own
    NCCL_HOSTID, so that ``ditscale.sp.Mesh.from_process_group`` sees ``machines`` hosts. The
    agents' outputs joined; the return code the first non-zero one."""
    from gloo_util import free_port

    port = str(free_port())
    procs = []
    for m in range(machines):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={machines}",
               f"--nproc-per-node={per_machine}", f"--node-rank={m}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "ditscale.train",
               *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=dict(env(), NCCL_HOSTID=f"emulated-machine-{m}"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(procs[0].args, code, "".join(o for o, _ in outs),
                                       "".join(e for _, e in outs))


def metrics_lines(out) -> list:
    """The run folder's metrics.jsonl, one dict per step."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    """A run that exited 0, else its output's tail."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
