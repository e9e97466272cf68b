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


def _need_one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import ditscale.ops as ops
    if not ops.is_available() or not hasattr(torch.ops.ditscale, "sp_replay_compute"):
        pytest.skip("ditscale._C without the CUDA sequence-parallel runtime")


@pytest.mark.parametrize("strategy,chunks,mesh,rank", [
    ("ulysses", 1, (1, 2), 1), ("ulysses-overlap", 1, (1, 2), 0), ("ulysses-overlap", 1, (2, 2), 3),
    ("ulysses", 2, (1, 2), 0), ("ring", 1, (1, 4), 2), ("torus", 2, (2, 2), 1),
    ("usp", 1, (2, 2), 0)])
@pytest.mark.parametrize("transport", ["nccl", "nvshmem"])
def test_replay_compute_runs_one_ranks_schedule(strategy, chunks, mesh, rank, transport):
    """The compute-only replay (one GPU, transfers skipped) runs every kind of schedule, one-sided
    ones without NVSHMEM, and its trace holds exactly the rank's attention calls."""
    _need_one_gpu()
    from ditscale._experimental.sp_local import replay_compute
    head = strategy == "ulysses"  # its chunks are head chunks
    ms, tl = replay_compute(strategy, machines=mesh[0], gpus_per_machine=mesh[1], rank=rank,
                            seq=3000, text=40, heads=8, kv_heads=4, head_dim=64,
                            chunks=None if head else chunks,
                            ulysses_chunks=chunks if head else None, transport=transport,
                            iters=2, warmup=1)
    assert len(ms) == 2 and all(t > 0 for t in ms)
    torch.cuda.synchronize()
    calls = [ln for ln in tl.splitlines() if "] Attention '" in ln]
    assert calls, tl
    if strategy == "ulysses-overlap":
        assert sum("overlap" in ln for ln in calls) == 3, tl
    with pytest.raises(RuntimeError, match="rank"):
        replay_compute(strategy, machines=mesh[0], gpus_per_machine=mesh[1],
                       rank=mesh[0] * mesh[1], seq=3000, heads=8, head_dim=64)


def test_copy_engine_ranks_in_one_process_match_dense():
    """Every one-sided strategy through the copy-engine engine (puts by cudaMemcpyAsync, signals
    by stream memory operations), all ranks in one process on one GPU (sp_local_check.py)."""
    _need_one_gpu()
    if not hasattr(torch.ops.ditscale, "sp_run_local"):
        pytest.skip("ditscale._C without sp_run_local")
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="32", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "sp_local_check.py")], env=env,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout[-20000:])
    print(r.stderr[-5000:])
    assert r.returncode == 0, "sp_local_check failed (see the table above)"


def test_sm_partition_runs_the_compute_stream_on_fewer_sms():
    """comm_sms > 0: the executor's compute stream is a green-context stream of an SM partition
    (replay: the schedule's compute is not faster than on the whole GPU, and a partition that
    leaves no SM for compute is refused naming comm_sms); every rank of a one-process run on
    partitions matches dense attention."""
    _need_one_gpu()
    from ditscale._experimental.sp_local import replay_compute
    kw = dict(machines=1, gpus_per_machine=2, seq=8192, text=64, heads=8, head_dim=128,
              iters=3, warmup=1)
    whole, _ = replay_compute("ulysses", **kw)
    part, _ = replay_compute("ulysses", comm_sms=4, **kw)
    assert min(part) >= 0.9 * min(whole), (part, whole)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(RuntimeError, match="comm_sms"):
        replay_compute("ulysses", comm_sms=sms, **kw)
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="32", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "sp_local_check.py"), "--quick",
                        "--comm-sms", "4"], env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-20000:])
    print(r.stderr[-5000:])
    assert r.returncode == 0, "sp_local_check --comm-sms 4 failed (see the table above)"
