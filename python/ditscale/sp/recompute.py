"""The backward of the multi-rank attention on CPU tensors over gloo by recomputation: the layer
run again (without autograd) with a schedule whose program is transposable, then that program
transposed (cpu_backward.py).

The schedule: the call's own when its program is transposable (every region written once but
for merges of partial attention outputs into an accumulator's rows: ulysses, ulysses-overlap,
torus), else Ulysses over the same group (attention is the same function whatever the
schedule). With GQA and fewer kv heads than ranks, the kv heads are repeated for the
recomputation (Ulysses gives every rank at least one) and their gradients summed back; a layer
with fewer query heads than ranks takes torch_backward.py's instead. Used by the eager backward
of a schedule with neither a transposable program nor a backward of its own (:func:`own`:
ring_backward.py for a plain ring, usp_backward.py for a Ulysses x ring program; grad.py) and
by the backward op that torch.compile traces (custom_op.py), where a schedule with its own
backward runs its forward again, then that backward. docs/sp.md ("Gradients").
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from . import cpu_backward, cpu_runtime, ring_backward, torch_backward, usp_backward
from .config import Config
from .meshes import Mesh
from .torch_backward import fold_kv, repeat_kv

WHERE = "ditscale.sp.attention"
Joint = Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def transposable(prog) -> bool:
    try:
        cpu_backward.check_transposable(prog, WHERE)
    except ValueError:
        return False
    return True


def _ulysses(cfg: Config) -> Config:
    return Config(strategy="ulysses", transport="nccl", comm_sms=0, topology=cfg.topology)


def _kv_groups(q, k, mesh: Mesh) -> int:
    """How many times the recomputation repeats each kv head: 1, or the GQA group size when
    there are fewer kv heads than ranks."""
    return 1 if k.shape[2] >= mesh.size else q.shape[2] // k.shape[2]


def plan(q, k, joint: Joint, mesh: Mesh, cfg: Config) -> Optional[Tuple[Config, int]]:
    """(the configuration the layer is recomputed with, kv head repeats), or None when no
    Ulysses schedule splits the layer (fewer query heads than ranks): the caller then takes the
    backward of torch_backward.py, which leaves ranks without heads idle. Alike on every rank
    (the shape is the group's)."""
    prog = cpu_runtime.program_for(q, k, joint, mesh, cfg, WHERE)
    if transposable(prog):
        return cfg, 1
    g = _kv_groups(q, k, mesh)
    if joint is not None:
        joint = (joint[0], repeat_kv(joint[1], g), joint[2])
    try:
        cpu_runtime.program_for(q, repeat_kv(k, g), joint, mesh, _ulysses(cfg), WHERE)
    except ValueError:
        return None
    return _ulysses(cfg), g


def run_kept(q, k, v, joint: Joint, mesh: Mesh, cfg: Config, g: int):
    """(program, process group, timeout in s, {buffer index: saved tensor}) of the layer run
    with ``cfg`` on the inputs (kv heads repeated g times), without autograd."""
    k, v = repeat_kv(k, g), repeat_kv(v, g)
    if joint is not None:
        joint = (joint[0], repeat_kv(joint[1], g), repeat_kv(joint[2], g))
    with torch.no_grad():
        _, _, (prog, pg, seconds, bufs) = cpu_runtime.attention_kept(q, k, v, joint, mesh, cfg,
                                                                     WHERE)
    return prog, pg, seconds, {i: bufs[i] for i in cpu_backward.saved_buffers(prog)}


def transposed(prog, pg, seconds: float, saved, dout: torch.Tensor,
               djout: Optional[torch.Tensor], g: int) -> Dict[str, torch.Tensor]:
    """The float32 gradients {"q", "k", "v", "text_q", ...: those the program has} of the
    program's inputs from dOut (and dJointOut), kv heads folded back."""
    grads_out = {"out": dout}
    if prog.io["text_out"] >= 0:
        grads_out["text_out"] = djout
    try:
        grads = cpu_backward.backward(prog, pg, saved, grads_out, dout.shape[0], seconds)
    except RuntimeError as e:
        raise RuntimeError(f"{WHERE}: {prog.strategy} backward (its program transposed): "
                           f"{e}") from None
    for name in ("k", "v", "text_k", "text_v"):
        if name in grads:
            grads[name] = fold_kv(grads[name], g)
    return grads


def own(q, k, joint: Joint, mesh: Mesh, run):
    """(module, state) of the schedule's own backward for the forward ``run``
    (cpu_runtime.attention_kept's program, group, timeout, buffers): ring_backward for a plain
    ring (ulysses_degree 1: ring, auto resolved so, usp / swiftfusion-tas / torus of degree 1),
    usp_backward for a Ulysses x ring program; None for any other (or a layout that some rank
    of the group does not find: the decision is agreed, cpu_runtime.agreed_layout).
    The module's ``saved(state, inputs, buffers)`` is what the forward keeps, its
    ``backward(state, saved, dout, djout)`` the gradients."""
    prog = run[0]
    if prog.ring_degree < 2:
        return None
    if prog.ulysses_degree == 1:
        found = ring_backward.state(q, k, joint, mesh, run)
        return None if found is None else (ring_backward, found)
    found = usp_backward.state(mesh, run)
    return None if found is None else (usp_backward, found)


def _own_again(q, k, v, joint: Joint, dout, djout, mesh: Mesh, cfg: Config):
    """The own backward's gradients after running the forward again (without autograd; the
    backward op torch.compile traces keeps only the inputs), None for a schedule without one."""
    prog = cpu_runtime.program_for(q, k, joint, mesh, cfg, WHERE)
    if prog.ring_degree < 2:
        return None
    if prog.ulysses_degree > 1 and usp_backward.layout_of(prog, mesh) is None:
        return None
    with torch.no_grad():
        run = cpu_runtime.attention_kept(q, k, v, joint, mesh, cfg, WHERE)[2]
    found = own(q, k, joint, mesh, run)
    if found is None:
        return None
    module, state = found
    kept = module.saved(state, (q, k, v, *(joint or (None,) * 3)), run[3])
    return module.backward(state, kept, dout, djout)


def gradients(q, k, v, joint: Joint, dout, djout, mesh: Mesh,
              cfg: Config) -> Dict[str, torch.Tensor]:
    """The gradients of the layer's inputs (see :func:`transposed`): a schedule's own backward
    after its forward again (:func:`own`), else by recomputation (with no Ulysses split of the
    layer: torch_backward.py's)."""
    grads = _own_again(q, k, v, joint, dout, djout, mesh, cfg)
    if grads is not None:
        return grads
    planned = plan(q, k, joint, mesh, cfg)
    if planned is None:
        return torch_backward.gradients(q, k, v, joint, dout, djout, mesh)
    prog, pg, seconds, saved = run_kept(q, k, v, joint, mesh, *planned)
    return transposed(prog, pg, seconds, saved, dout, djout, planned[1])
