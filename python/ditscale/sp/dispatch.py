"""The kernel of ``torch.ops.ditscale_sp.attention`` (custom_op.py) on more than one rank: CUDA
tensors to the GPU runtime (gpu_runtime.py: NCCL / NVSHMEM, the SpRuntime of ditscale._C), CPU
tensors to the CPU executor over gloo (cpu_runtime.py). Checks what both need: an initialized
torch.distributed and a device and dtype that one of them runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import cpu_runtime, gpu_runtime
from .config import Config
from .meshes import Mesh


def distributed_attention(q, k, v, joint, mesh: Mesh, cfg: Config):
    """The real kernel of torch.ops.ditscale_sp.attention: (out, joint_out or None)."""
    where = "ditscale.sp.attention"
    check_distributed(q, mesh, where)
    if q.is_cuda:
        return gpu_runtime.attention(q, k, v, joint, mesh, cfg, where)
    return cpu_runtime.attention(q, k, v, joint, mesh, cfg, where)


def check_distributed(q, mesh: Mesh, where: str) -> None:
    """ValueError unless torch.distributed is initialized and q's device and dtype run."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{where}: a mesh of {mesh.size} ranks needs torch.distributed "
                         f"initialized (one process per rank): NCCL for CUDA tensors, gloo for "
                         f"CPU tensors")
    if q.is_cuda:
        return
    if q.device.type != "cpu":
        raise ValueError(f"{where}: q, k, v on {q.device}: a mesh of {mesh.size} ranks runs "
                         f"CUDA tensors (NCCL) or CPU tensors (gloo)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: CPU tensors of dtype {q.dtype}: float32, bfloat16 or "
                         f"float16")
