#!/usr/bin/env python3
"""Train a Wan-2.1-style DiT (random init, synthetic data) on a manifest's shapes with an
AdaptiveLoad policy, and measure the load balance (the measurements of docs/balance.md). To
train on your own data (a latent store), with checkpoints and validation, use
``python -m ditscale.train`` (docs/train.md).

    torchrun --nproc-per-node 2 bench/train/policies.py \\
        --manifest examples/manifests/mixed_2k.csv --model wan2.1-1.3b --num-layers 8 \\
        --policy balanced --steps 30 --cost cost.json --log-json balanced.jsonl
    python bench/train/policies.py --model tiny --device cpu ...      (world size 1, no torchrun)
    ... --model-impl diffusers [--weights DIR]     (diffusers' WanTransformer3DModel instead)

Model (``--model-impl``): ``ditscale`` (default) trains ditscale's WanDiT
(``ditscale.models.wan_dit``) of the ``--model`` preset; ``diffusers`` trains diffusers'
``WanTransformer3DModel`` of the same dimensions (random weights from ``--seed``), or the local
checkpoint folder ``--weights DIR`` (its dimensions; ``--model`` then gives only the padded text
length), with ``ditscale.diffusers.apply_fused_adaln`` unless ``--no-fused-adaln``
(``ditscale.models.diffusers_wan``). Everything else (sampler, data, FSDP2 layout, step, logs)
is the same for both.

Data: ``ditscale.BalancedBatchSampler`` (one item per micro-batch; ``balanced`` gives a rank
several micro-batches per step, trained with gradient accumulation) inside a
``torch.utils.data.DataLoader`` over ``ManifestShapes``, a Dataset whose item for a sample id is
its training shape (via ``ditscale.train_shape`` of the manifest row). The tensors themselves
(latents, noise, time, text embeddings) are synthesised on the device from (seed, epoch, id), so
a sample is the same whatever the policy (``ditscale.models.training.SyntheticData``).

Step and timing (``ditscale.models.training.StepRunner``, sync mode ``timed``, the default):
all-gather the FSDP2 shards; forward + backward of every micro-batch of the step with gradient
sync off (no communication) -> compute_s; a timed barrier (all_reduce of one element, then
synchronize) -> wait_s, the time this rank idles until the slowest rank has finished its compute;
then the gradient reduce-scatter (a 1-token sync pass) -> sync_s and AdamW -> optim_s.
``--sync native`` lets FSDP2 overlap the reduce-scatter with the last backward (wait_s unknown).
The synthetic data of a step is generated before the step's clock starts (it stands in for a
data loader that keeps up), so the step times are training only.

Per step and rank (``--log-json``, one JSON line each): compute_s, wait_s, sync_s, optim_s,
step_s, tokens, samples, micro_batches; per step: the global loss (mean per-sample flow-matching
MSE). Summary (first ``--warmup-steps`` steps excluded from the timing metrics):
  tokens_per_s         tokens trained by all ranks / sum of step times
  compute_cv           mean over steps of std_r(compute_s) / mean_r(compute_s)
  bubble_fraction      sum of wait_s / sum of step_s over all (step, rank): idle share
  compute_bubble       sum_k (W * max_r compute - sum_r compute) / (W * sum_k max_r compute),
                       the simulator's definition applied to measured compute
  step_time_cv         std_k(step_s) / mean_k(step_s)
and the simulator's prediction for the same steps of the same plan (``--cost`` JSON: per rank
and step a + sum_i B_i * Work(S_i), as ``ditscale plan`` simulates), plus the sampler's
whole-epoch plan summary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Dict, List

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import ditscale
from ditscale.models.training import (
    IMPLS,
    StepRunner,
    SyntheticData,
    build_model,
    init_distributed,
    peak_memory_bytes,
)
from ditscale.models.wan_dit import latent_shape, make_config


class ManifestShapes(Dataset):
    """Item ``i`` (a sample id: 0-based manifest data row) is its training shape:
    ``{"id", "frames", "height", "width", "seq_len"}`` for the ditscale model ``shape_model``."""

    def __init__(self, manifest: str, shape_model: str, skip_bad_rows: bool = False):
        m = ditscale.read_manifest(manifest, skip_bad_rows=skip_bad_rows)
        self.ids = np.asarray(m.ids, dtype=np.int64)
        raw = np.stack([m.num_frames, m.height, m.width, m.fps.astype(np.float64)], axis=1)
        uniq, inverse = np.unique(raw, axis=0, return_inverse=True)
        table = []
        for f, h, w, fps in uniq:
            t = ditscale.train_shape(int(f), int(h), int(w), float(fps), shape_model)
            lt, lh, lw = latent_shape(t["frames"], t["height"], t["width"])
            if lt * (lh // 2) * (lw // 2) != t["seq_len"]:
                raise ValueError(f"{manifest}: model {shape_model!r} maps {int(f)}x{int(h)}x"
                                 f"{int(w)} to {t} whose tokens differ from the Wan patchify")
            table.append((t["frames"], t["height"], t["width"], t["seq_len"]))
        self.shape_table = np.asarray(table, dtype=np.int64).reshape(-1, 4)
        self.shape_index = np.asarray(inverse, dtype=np.int64).reshape(-1)

    def __len__(self) -> int:
        return len(self.ids)

    def _row(self, sample_id: int) -> int:
        r = int(np.searchsorted(self.ids, sample_id))
        if r >= len(self.ids) or self.ids[r] != sample_id:
            raise IndexError(f"sample id {sample_id} is not in the manifest")
        return r

    def shape(self, sample_id: int):
        return tuple(int(v) for v in self.shape_table[self.shape_index[self._row(sample_id)]])

    def __getitem__(self, sample_id: int) -> Dict[str, int]:
        f, h, w, s = self.shape(sample_id)
        return {"id": int(sample_id), "frames": f, "height": h, "width": w, "seq_len": s}


def collate_shapes(items: List[Dict[str, int]]) -> Dict:
    """A micro-batch's ids and its one shape (the planner never mixes shapes in a micro-batch)."""
    shapes = {(it["frames"], it["height"], it["width"]) for it in items}
    if len(shapes) != 1:
        raise ValueError(f"micro-batch mixes training shapes {sorted(shapes)}")
    (f, h, w), = shapes
    return {"ids": [it["id"] for it in items], "frames": f, "height": h, "width": w,
            "seq_len": items[0]["seq_len"]}


# ---------------------------------------------------------------------------------------------
# Prediction from a cost-model JSON (ditscale fit --out), as the simulator computes it.


def load_cost(path: str) -> Dict:
    with open(path) as f:
        c = json.load(f)
    if c.get("kind") not in ("power", "quadratic"):
        raise SystemExit(f"{path}: field 'kind' must be \"power\" or \"quadratic\"")
    return c


def work(cost: Dict, s: int) -> float:
    if cost["kind"] == "power":
        return cost["b"] * float(s) ** cost["p"]
    return cost["c1"] * s + cost["c2"] * float(s) ** 2


def predict_steps(sampler, dataset: ManifestShapes, cost: Dict, steps: List[int], world: int):
    """Per (step, rank) predicted cost a + sum_i (a_mb + B_i * Work(S_i)) for the given steps:
    a once per optimizer step, a_mb per micro-batch pass (0 in cost files without it)."""
    a_mb = float(cost.get("a_mb", 0.0))
    out = []
    for k in steps:
        row = []
        for r in range(world):
            mbs = sampler.cell(k, r)
            c = cost["a"] if mbs else 0.0
            for ids in mbs:
                c += a_mb + len(ids) * work(cost, dataset.shape(ids[0])[3])
            row.append(c)
        out.append(row)
    return np.asarray(out, dtype=np.float64).reshape(len(steps), world)


def balance_metrics(compute: np.ndarray, step_s: np.ndarray, tokens: float) -> Dict:
    """compute [K, W] per-rank compute, step_s [K] step times."""
    k, w = compute.shape
    mean = compute.mean(axis=1)
    cv = float(np.mean(np.where(mean > 0, compute.std(axis=1) / np.maximum(mean, 1e-30), 0)))
    peak = compute.max(axis=1)
    bubble = float((w * peak - compute.sum(axis=1)).sum() / max(w * peak.sum(), 1e-30))
    total = float(step_s.sum())
    return {
        "compute_cv": cv,
        "compute_bubble": bubble,
        "step_time_cv": float(step_s.std() / step_s.mean()) if k and step_s.mean() > 0 else 0.0,
        "time_s": total,
        "tokens_per_s": tokens / total if total > 0 else 0.0,
        "tokens_per_s_per_gpu": tokens / total / w if total > 0 else 0.0,
    }


FIELDS = ["compute_s", "wait_s", "sync_s", "optim_s", "step_s", "gather_s", "tokens", "samples",
          "micro_batches", "loss_sum", "peak_mem_bytes"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--model", default="wan2.1-1.3b", help="DiT config: wan2.1-1.3b, "
                    "wan2.1-14b, tiny")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--model-impl", default="ditscale", choices=list(IMPLS),
                    help="ditscale's WanDiT or diffusers' WanTransformer3DModel")
    ap.add_argument("--weights", default=None, help="--model-impl diffusers: a local diffusers "
                    "WanTransformer3DModel folder (config.json + weights) instead of random init")
    ap.add_argument("--shape-model", default=None, help="ditscale preset or JSON model file for "
                    "shapes and planning (default: --model when it is a ditscale preset)")
    ap.add_argument("--policy", default="balanced", choices=["equal-token", "adaptive",
                                                             "balanced"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the timing "
                    "summary")
    ap.add_argument("--cost", default=None, help="cost-model JSON (ditscale fit --out)")
    ap.add_argument("--bench", default=None, help="shape-benchmark CSV to fit the cost from")
    ap.add_argument("--m-mem", type=int, default=None, help="M_mem, tokens per micro-batch")
    ap.add_argument("--m-comp", type=float, default=None)
    ap.add_argument("--rank-budget-s", type=float, default=None)
    ap.add_argument("--gpu-mem-gib", type=float, default=141.0)
    ap.add_argument("--tail", default="drop", choices=["drop", "pad", "keep"])
    ap.add_argument("--skip-bad-rows", action="store_true")
    ap.add_argument("--no-fused-adaln", action="store_true")
    ap.add_argument("--sync", default="timed", choices=["timed", "native"])
    ap.add_argument("--log-json", default=None, help="JSONL log (rank 0 writes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--pg-timeout-s", type=float, default=60.0)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop after the step that crosses this wall time")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup_steps < 0:
        ap.error("--steps must be >= 1 and --warmup-steps >= 0")
    if args.weights is not None and args.model_impl != "diffusers":
        ap.error(f"--weights {args.weights!r} needs --model-impl diffusers")
    return args


def model_config(args):
    """The WanConfig to train: the --model preset (and --num-layers), or --weights' dimensions."""
    cfg = make_config(args.model, None if args.weights else args.num_layers)
    if args.weights is None:
        return cfg
    from ditscale.models import diffusers_wan

    try:
        return diffusers_wan.checkpoint_config(args.weights, cfg, args.num_layers)
    except (ValueError, ImportError) as e:
        raise SystemExit(str(e)) from e


def check_fused(args) -> None:
    """The fused AdaLN ops (and, for diffusers, apply_fused_adaln's Wan module) are there."""
    from ditscale import ops

    if not ops.is_available():
        raise SystemExit(f"fused AdaLN requested but {ops.load_error()}; pass --no-fused-adaln")
    if args.model_impl == "diffusers":
        from ditscale.models import diffusers_wan

        try:
            diffusers_wan.fused_adaln_function()
        except RuntimeError as e:
            raise SystemExit(str(e)) from e


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = model_config(args)
    if not args.no_fused_adaln:
        check_fused(args)
    env = init_distributed(args.device, args.pg_timeout_s)
    try:
        train(args, env, cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def train(args, env, cfg) -> Dict:
    """Trains on the initialised process group; returns the summary (every rank)."""
    dev, world, rank, is0 = env.device, env.world_size, env.rank, env.rank == 0
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    shape_model = args.shape_model or (args.model if args.model in ditscale.model_presets()
                                       else "wan2.1-1.3b")
    fused = not args.no_fused_adaln

    def log(msg):
        if is0:
            print(msg, flush=True)

    sampler = ditscale.BalancedBatchSampler(
        args.manifest, rank, world, model=shape_model, policy=args.policy, seed=args.seed,
        cost=args.cost, bench=args.bench, m_mem_tokens=args.m_mem, m_comp=args.m_comp,
        rank_budget_s=args.rank_budget_s, gpu_mem_gib=args.gpu_mem_gib, tail=args.tail,
        skip_bad_rows=args.skip_bad_rows, mode="micro_batch")
    dataset = ManifestShapes(args.manifest, shape_model, args.skip_bad_rows)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_shapes,
                        num_workers=args.num_workers)
    plan = sampler.plan_summary
    log(f"policies: {args.model_impl} {cfg.name} ({cfg.num_layers} layers, dim {cfg.dim}), "
        f"world size {world}, "
        f"{dev.type}, {dtype}, fused AdaLN {'on' if fused else 'off'}, sync {args.sync}; policy "
        f"{args.policy}: {plan['num_steps']} steps/epoch, M_mem {plan['m_mem_tokens']}, "
        f"M_comp {plan['m_comp']:.4g}, p {plan['p']:.3f}, cost {plan.get('cost_source')}")

    model, optimizer = build_model(cfg, dev, fused_adaln=fused, dtype=dtype, seed=args.seed,
                                   lr=args.lr, impl=args.model_impl, weights=args.weights)
    runner = StepRunner(model, optimizer, dev, sync_mode=args.sync, cfg=cfg, dtype=dtype)
    data = SyntheticData(cfg, dev, dtype, seed=args.seed)
    jsonl = open(args.log_json, "w") if (is0 and args.log_json) else None
    records = []  # per global step: (epoch, step, [W, len(FIELDS)] array, loss)
    t_start = time.monotonic()  # the --time-budget-s deadline (the step times: StepRunner)
    gstep, epoch = 0, 0
    while gstep < args.steps:
        sampler.set_epoch(epoch)
        counts = sampler.micro_batches_per_step()
        if not counts:
            raise SystemExit("the plan has no steps (manifest too small for the world size?)")
        it = iter(loader)
        for k, n in enumerate(counts):
            metas = [next(it) for _ in range(n)]
            global_samples = sum(len(ids) for r in range(world) for ids in sampler.cell(k, r))
            mbs = [data.for_pixels(m["ids"], m["frames"], m["height"], m["width"], epoch)
                   for m in metas]
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            st = runner.step(mbs, world / max(global_samples, 1))
            del mbs
            if st.oom:
                raise SystemExit(f"out of memory at epoch {epoch} step {k} on some rank: lower "
                                 "--m-mem or use a smaller model")
            local = torch.tensor([getattr(st, f) if f != "peak_mem_bytes" else
                                  peak_memory_bytes(dev) for f in FIELDS],
                                 dtype=torch.float64, device=dev)
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            rows = torch.stack(gathered).cpu().numpy()
            loss = float(rows[:, FIELDS.index("loss_sum")].sum() /
                         max(rows[:, FIELDS.index("samples")].sum(), 1))
            records.append((epoch, k, rows, loss))
            if is0:
                c = rows[:, 0]
                print(f"step {gstep:4d} (epoch {epoch} step {k}) loss {loss:.4f} | step "
                      f"{rows[:, 4].max():.3f} s, compute {c.min():.3f}-{c.max():.3f} s, wait "
                      f"max {np.nanmax(rows[:, 1]) if world else 0:.3f} s, sync "
                      f"{rows[:, 2].max():.3f} s | {int(rows[:, 6].sum())} tokens, "
                      f"{int(rows[:, 7].sum())} samples, micro-batches "
                      f"{'/'.join(str(int(x)) for x in rows[:, 8])}", flush=True)
                if jsonl:
                    for r in range(world):
                        d = {"type": "rank_step", "step": gstep, "epoch": epoch,
                             "epoch_step": k, "rank": r}
                        d.update({f: (None if math.isnan(v) else
                                      (int(v) if f in ("tokens", "samples", "micro_batches",
                                                       "peak_mem_bytes") else float(v)))
                                  for f, v in zip(FIELDS, rows[r])})
                        jsonl.write(json.dumps(d) + "\n")
                    jsonl.write(json.dumps({"type": "step", "step": gstep, "epoch": epoch,
                                            "epoch_step": k, "loss": loss,
                                            "step_s": float(rows[:, 4].max()),
                                            "samples": int(rows[:, 7].sum()),
                                            "tokens": int(rows[:, 6].sum())}) + "\n")
                    jsonl.flush()
            gstep += 1
            elapsed = torch.tensor([time.monotonic() - t_start], dtype=torch.float64,
                                   device=dev)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            over = args.time_budget_s is not None and elapsed.item() > args.time_budget_s
            if gstep >= args.steps or over:
                if over:
                    log(f"time budget {args.time_budget_s:.0f} s reached after {gstep} steps")
                    args.steps = gstep
                break
        epoch += 1

    summary = summarize(args, records, sampler, dataset, world, plan, fused, cfg)
    if is0:
        print_summary(summary)
        if jsonl:
            jsonl.write(json.dumps({"type": "summary", **summary}) + "\n")
            jsonl.close()
    dist.barrier()
    return summary


def summarize(args, records, sampler, dataset, world, plan, fused, cfg) -> Dict:
    timed = records[args.warmup_steps:] if len(records) > args.warmup_steps else records
    idx = {f: i for i, f in enumerate(FIELDS)}
    comp = np.stack([r[2][:, idx["compute_s"]] for r in timed])
    step_s = np.array([r[2][:, idx["step_s"]].max() for r in timed])
    tokens = float(sum(r[2][:, idx["tokens"]].sum() for r in timed))
    waits = np.stack([r[2][:, idx["wait_s"]] for r in timed])
    rank_time = np.stack([r[2][:, idx["step_s"]] for r in timed])
    m = balance_metrics(comp, step_s, tokens)
    m["bubble_fraction"] = (float(np.nansum(waits) / rank_time.sum())
                            if not np.isnan(waits).all() else None)
    m["mean_wait_s"] = float(np.nanmean(waits)) if not np.isnan(waits).all() else None
    m["mean_sync_s"] = float(np.mean([r[2][:, idx["sync_s"]].max() for r in timed]))
    m["peak_mem_bytes"] = int(max(r[2][:, idx["peak_mem_bytes"]].max() for r in records))
    out = {
        "policy": args.policy, "model": cfg.name, "model_impl": args.model_impl,
        "weights": args.weights,
        "num_layers": cfg.num_layers,
        "world_size": world, "fused_adaln": fused, "sync": args.sync,
        "steps": len(records), "timed_steps": len(timed), "tokens": int(tokens),
        "measured": m,
        "loss": [r[3] for r in records],
        "plan": {k: v for k, v in plan.items() if not isinstance(v, list)},
    }
    if args.cost:
        # Same steps (epoch 0 of the plan only: later epochs are re-planned), same cost model.
        ep0 = [r[1] for r in timed if r[0] == 0]
        if ep0 and sampler.epoch != 0:
            sampler.set_epoch(0)
        if ep0:
            cost = load_cost(args.cost)
            pred = predict_steps(sampler, dataset, cost, ep0, world)
            ptok = float(sum(r[2][:, idx["tokens"]].sum() for r in timed if r[0] == 0))
            p = balance_metrics(pred, pred.max(axis=1), ptok)
            p["steps"] = len(ep0)
            p["a_s"], p["a_mb_s"] = float(cost["a"]), float(cost.get("a_mb", 0.0))
            mt = balance_metrics(
                np.stack([r[2][:, idx["compute_s"]] for r in timed if r[0] == 0]),
                np.array([r[2][:, idx["step_s"]].max() for r in timed if r[0] == 0]), ptok)
            p["measured_over_predicted_tokens_per_s"] = (
                mt["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] > 0 else None)
            out["predicted"] = p
    return out


def print_summary(s: Dict) -> None:
    m, plan = s["measured"], s["plan"]
    print(f"\n== summary: policy {s['policy']}, {s['model_impl']} {s['model']} x"
          f"{s['num_layers']} layers, world "
          f"{s['world_size']}, fused AdaLN {'on' if s['fused_adaln'] else 'off'}, "
          f"{s['timed_steps']} timed steps of {s['steps']}")
    rows = [("tokens/s", f"{m['tokens_per_s']:,.0f}"),
            ("tokens/s per GPU", f"{m['tokens_per_s_per_gpu']:,.0f}"),
            ("compute-load CV", f"{100 * m['compute_cv']:.1f}%"),
            ("bubble fraction (wait / rank time)",
             "n/a" if m["bubble_fraction"] is None else f"{100 * m['bubble_fraction']:.1f}%"),
            ("bubble (simulator definition)", f"{100 * m['compute_bubble']:.1f}%"),
            ("step-time CV", f"{100 * m['step_time_cv']:.1f}%"),
            ("peak memory (max rank)", f"{m['peak_mem_bytes'] / 2**30:.2f} GiB"),
            ("loss first -> last", f"{s['loss'][0]:.4f} -> {s['loss'][-1]:.4f}")]
    if "predicted" in s:
        p = s["predicted"]
        rows += [("predicted tokens/s (same steps)", f"{p['tokens_per_s']:,.0f}"),
                 ("predicted compute-load CV", f"{100 * p['compute_cv']:.1f}%"),
                 ("predicted bubble", f"{100 * p['compute_bubble']:.1f}%"),
                 ("measured / predicted tokens/s",
                  f"{p['measured_over_predicted_tokens_per_s']:.3f}")]
    if "tokens_per_s_per_gpu" in plan:
        rows += [("plan (epoch) tokens/s per GPU", f"{plan['tokens_per_s_per_gpu']:,.0f}"),
                 ("plan (epoch) compute CV", f"{100 * plan['compute_cv']:.1f}%"),
                 ("plan (epoch) bubble", f"{100 * plan['bubble_fraction']:.1f}%")]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")


if __name__ == "__main__":
    sys.exit(main())
