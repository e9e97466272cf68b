"""Runs tests/gpu/sp_attention_check.py under torchrun on 2 GPUs (NVLink, then two emulated
machines over NCCL's socket transport). Skips without 2 GPUs or without the compiled runtime."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _need_two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    import ditscale.ops as ops
    if not ops.is_available() or not hasattr(torch.classes.ditscale, "SpRuntime"):
        pytest.skip("ditscale._C without the CUDA sequence-parallel runtime")


@pytest.mark.parametrize("emulate", [0, 2])
def test_sp_attention_matches_dense(emulate):
    _need_two_gpus()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "sp_attention_check.py")]
    if emulate:
        cmd += ["--emulate-machines", str(emulate), "--quick"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-20000:])
    print(r.stderr[-5000:])
    assert r.returncode == 0, "sp_attention_check failed (see the table above)"
