"""The run's logs on rank 0: OUT/metrics.jsonl (one JSON line per step), TensorBoard event
files (OUT/tensorboard) and a tqdm progress bar.

A line of metrics.jsonl: step (optimizer steps done, 1-based), epoch, loss (mean per-sample
flow-matching MSE over every rank's samples), lr (used by this step), grad_norm (before
clipping), tokens and samples (the store ids trained in this step over all ranks, rank order),
tokens_per_s, step_time_s (rank 0's wall time of the step, data wait included), data_wait_s
(rank 0's wait for its loader), compute_s and wait_s per rank (wait: idle at the step's barrier
until the slowest rank finished: the imbalance), micro_batches per rank, shapes (per rank, each
micro-batch's [B, C, F', H', W']), and validation (files written after this step, if any).
On resume, the lines after the checkpoint's step are dropped (they are trained again).
See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

METRICS = "metrics.jsonl"
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s")


def truncate_after(path: str, step: int) -> None:
    """Keeps the lines of ``path`` whose step is <= ``step`` (atomic rewrite)."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                break  # a line cut by a kill: nothing after it is kept
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


class RunLog:
    """Rank 0 writes; the other ranks' calls do nothing."""

    def __init__(self, out: str, rank: int, total_steps: int, start_step: int,
                 tensorboard: bool, progress: bool):
        self.active = rank == 0
        self.jsonl = self.tb = self.bar = None
        if not self.active:
            return
        path = os.path.join(out, METRICS)
        truncate_after(path, start_step)
        self.jsonl = open(path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out, "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None)
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step",
                            dynamic_ncols=True)

    def step(self, record: Dict) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        k = record["step"]
        if self.tb is not None:
            for name in SCALARS:
                self.tb.add_scalar(f"train/{name}", record[name], k)
            self.tb.add_scalar("train/max_wait_s", max(record["wait_s"]), k)
            self.tb.add_scalar("train/tokens", record["tokens"], k)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")

    def image(self, tag: str, image, step: int) -> None:
        """A validation frame [H, W, 3] uint8 in TensorBoard."""
        if self.active and self.tb is not None:
            self.tb.add_image(tag, image, step, dataformats="HWC")

    def message(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self, final: Optional[Dict] = None) -> None:
        if not self.active:
            return
        for h in (self.bar, self.tb, self.jsonl):
            if h is not None:
                h.close()
