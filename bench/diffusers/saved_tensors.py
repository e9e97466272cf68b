#!/usr/bin/env python3
"""What a compiled block keeps for its backward, stock vs ``apply_fused_adaln``: the tensors
AOTAutograd's partitioner (the min-cut one inductor uses) saves between the forward and the
backward of every compiled block, and, compiled by inductor, the memory a forward leaves
allocated and the peak of forward + backward (GiB above the model and inputs).

    python -m bench.diffusers.saved_tensors [--models wan2.1-1.3b] [--tokens 32760]
        [--blocks 1] [--out-dir DIR]

Runs where the model runs (CUDA when present, else CPU; the partitioner's choice depends on the
graph, which depends on the attention op of the device). The saved tensors are grouped by
(producing op, shape, dtype) with their count and MB; the table is printed last and written to
DIR/saved-tensors.md with the raw rows in DIR/saved-tensors.json.
"""

from __future__ import annotations

import gc
import sys

from bench.diffusers import cli
from bench.diffusers import models as M
from bench.diffusers.adaln_models import blocks_of
from bench.diffusers.timing import GiB

MB = 1e6


def _recording_backend(saved: list, graphs: list):
    """An AOTAutograd backend that runs the partitioned graphs as traced and records what the
    forward hands the backward: each backward graph's inputs other than the incoming gradients
    (``tangents_*``), found by name among the forward graphs' nodes, appended to ``saved`` as
    (op, shape, dtype, bytes), graph inputs (weights, the block's input) and views of them left
    out; and each
    forward graph's node count to ``graphs`` (more graphs than blocks: a graph break)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    forward_nodes = []

    def fw(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        forward_nodes.append({n.name: n for n in gm.graph.nodes})
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        for ph in (n for n in gm.graph.nodes if n.op == "placeholder"):
            node = next((f[ph.name] for f in reversed(forward_nodes) if ph.name in f), None)
            val = ph.meta.get("val")
            if ph.name.startswith("tangents") or node is None or not hasattr(val, "numel") \
                    or _base(node).op == "placeholder":
                continue
            saved.append((_op_name(node), tuple(val.shape), str(val.dtype).replace("torch.", ""),
                          val.numel() * val.element_size()))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw,
                        partition_fn=min_cut_rematerialization_partition)


_VIEWS = ("view", "detach", "alias", "permute", "t", "transpose", "unsqueeze", "squeeze", "expand",
          "slice", "select", "as_strided", "_unsafe_view")


def _target_name(node) -> str:
    parts = str(node.target).split(".")
    return parts[1] if len(parts) >= 3 else str(node.target)


def _base(node):
    """The node a chain of views starts from (``node`` itself when it is no view)."""
    while node.op == "call_function" and _target_name(node) in _VIEWS and node.args:
        node = node.args[0]
    return node


def _op_name(node) -> str:
    """The op that made a graph node: ``addmm`` for aten.addmm.default; for a getitem, its
    source's op with the index (``adaln_mod_fwd[0]``); for a view or detach, what it views."""
    import operator

    if node.target is operator.getitem:
        return f"{_op_name(node.args[0])}[{node.args[1]}]"
    name = _target_name(node)
    if name in _VIEWS and node.args:
        return f"{name}({_op_name(node.args[0])})"
    return name


def _variant(name, tokens, blocks, fused, backend, dtype, dev):
    import ditscale.diffusers as dd

    model, _ = M.make(name, blocks, dtype, dev)
    model.train()
    if fused:
        dd.apply_fused_adaln(model)
    for b in blocks_of(model):
        b.compile(backend=backend)
    kw = M.inputs(name, model, tokens, 1, dtype, dev, seed=1)
    kw["hidden_states"].requires_grad_(True)
    return model, kw


def _memory(model, kw, dev):
    """(GiB left allocated by a forward, GiB peak of forward + backward), above the model and
    inputs, on CUDA; (nan, nan) elsewhere."""
    import torch

    if dev.type != "cuda":
        return float("nan"), float("nan")
    out = model(**kw)[0]
    out.backward(torch.ones_like(out))  # warm-up (compiles)
    model.zero_grad(set_to_none=True)
    kw["hidden_states"].grad = None
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = model(**kw)[0]
    torch.cuda.synchronize()
    fwd = torch.cuda.memory_allocated() - base
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return fwd / GiB, peak / GiB


def measure(name, tokens, blocks, fused, dtype, dev) -> dict:
    import torch

    saved, graphs = [], []
    model, kw = _variant(name, tokens, blocks, fused, _recording_backend(saved, graphs), dtype,
                         dev)
    out = model(**kw)[0]
    out.float().sum().backward()
    del model, kw, out
    torch._dynamo.reset()
    model, kw = _variant(name, tokens, blocks, fused, "inductor", dtype, dev)
    fwd, peak = _memory(model, kw, dev)
    del model, kw
    gc.collect()
    torch._dynamo.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    groups = {}
    for op, shape, dt, nbytes in saved:
        g = groups.setdefault((op, shape, dt), [0, 0])
        g[0] += 1
        g[1] += nbytes
    return {"variant": "fused" if fused else "stock", "tokens": tokens,
            "graphs": len(graphs),
            "saved_mb": sum(s[3] for s in saved) / MB, "fwd_gib": fwd, "peak_gib": peak,
            "groups": sorted(([op, list(shape), dt, n, b / MB]
                              for (op, shape, dt), (n, b) in groups.items()),
                             key=lambda g: -g[4])}


def table(rows) -> str:
    lines = ["| model | tokens | variant | fwd graphs | saved MB (partitioner) | "
             "fwd left GiB (inductor) | peak GiB (inductor) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['variant']} | {r['graphs']} | "
                     f"{r['saved_mb']:.1f} | "
                     f"{r['fwd_gib']:.3f} | {r['peak_gib']:.3f} |")
    for r in rows:
        lines.append(f"\nSaved tensors, {r['model']} {r['tokens']} {r['variant']} (op, shape, "
                     f"dtype, count, MB):\n")
        lines += [f"- {op} {tuple(shape)} {dt} x{n}: {mb:.1f}" for op, shape, dt, n, mb
                  in r["groups"] if mb >= 0.5]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import torch

    ap = cli.parser(__doc__, "wan2.1-1.3b", 1, 60.0)
    args = cli.parse(ap, argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in args.models:
        for tokens in args.tokens or [M.TOKENS[name][1]]:
            for fused in (False, True):
                row = measure(name, tokens, args.blocks, fused, torch.bfloat16, dev)
                row["model"] = name
                rows.append(row)
                print(f"{name} {tokens} {row['variant']}: saved {row['saved_mb']:.1f} MB, "
                      f"fwd {row['fwd_gib']:.3f} GiB, peak {row['peak_gib']:.3f} GiB",
                      flush=True)
    return cli.write(args.out_dir, "saved-tensors", rows, table(rows),
                     "What compiled blocks keep for the backward, stock vs fused")


if __name__ == "__main__":
    sys.exit(main())
