"""The attention layer of each configuration of bench_sp_attention.py: one GPU, the peers (plain
Ulysses, PyTorch CP) and ditscale's strategies, each as (step, outputs, close).

step() runs one layer; outputs() -> [(output, start, count)], the rows of the full [B, T+S, H, D]
sequence each output holds (compared with the reference by the check); close() frees what the
layer holds, or None. `full` is None for timing (random local inputs) or the check's (q, k, v)
[B, T+S, H, D], identical on every rank. Shapes and method: bench/README.md, docs/sp.md."""

from __future__ import annotations

from typing import Optional

from bench.sp import peers


def _rand(b, *shape):
    return b.torch.randn(*shape, device=b.device, dtype=b.dtype)


def single_layer(b, cfg, seq: int, full: Optional[tuple], backend: str):
    a = b.a
    L = a.text + seq
    q, k, v = full if full is not None else (_rand(b, a.batch, L, a.heads, a.head_dim)
                                             for _ in range(3))
    res = {}

    def step():
        with peers.sdpa_context(backend):
            res["o"] = peers.sdpa_bshd(q, k, v)

    return step, lambda: [(res["o"], 0, L)], None


def plain_ulysses_layer(b, cfg, seq: int, full: Optional[tuple], backend: str):
    a = b.a
    L = a.text + seq
    if L % b.world:
        raise ValueError(f"plain Ulysses needs T+S={L} divisible by {b.world} ranks")
    beg, cnt = peers.shard_range(L, b.world, b.rank)
    if full is not None:
        q, k, v = (x.narrow(1, beg, cnt).contiguous() for x in full)
    else:
        q, k, v = (_rand(b, a.batch, cnt, a.heads, a.head_dim) for _ in range(3))
    res = {}

    def step():
        with peers.sdpa_context(backend):
            res["o"] = peers.ulysses_attention(q, k, v)

    return step, lambda: [(res["o"], beg, cnt)], None


def torch_cp_layer(b, cfg, seq: int, full: Optional[tuple], backend: str):
    from torch.distributed.device_mesh import init_device_mesh

    a = b.a
    L = a.text + seq
    if L % b.world:
        raise ValueError(f"PyTorch CP needs T+S={L} divisible by {b.world} ranks")
    if "cp" not in b.meshes:
        b.meshes["cp"] = init_device_mesh("cuda", (b.world,), mesh_dim_names=("cp",))
    if full is not None:
        q, k, v = (x.transpose(1, 2).contiguous() for x in full)
    else:
        q, k, v = (_rand(b, a.batch, a.heads, L, a.head_dim) for _ in range(3))
    cp = peers.TorchContextParallel(b.meshes["cp"], q, k, v, a.cp_rotate)
    beg, cnt = peers.shard_range(L, b.world, b.rank)
    res = {}

    def step():
        with peers.sdpa_context(backend):
            res["o"] = cp()

    return step, lambda: [(res["o"].transpose(1, 2), beg, cnt)], cp.close


def ditscale_layer(b, cfg, seq: int, full: Optional[tuple], backend: str):
    """ditscale.sp.attention: the text tokens as joint q/k/v (replicated), the image tokens
    sharded by sp.shard_range (the SDPA backend is the library's own choice)."""
    a, sp = b.a, b.sp
    t, shape = a.text, (a.batch, a.heads, a.head_dim)
    mesh = b.mesh(cfg.mesh)
    beg, cnt = sp.shard_range(seq, mesh.size, mesh.rank)
    if full is not None:
        q, k, v = (x.narrow(1, t + beg, cnt).contiguous() for x in full)
        jq, jk, jv = (x.narrow(1, 0, t).contiguous() for x in full)
    else:
        q, k, v = (_rand(b, shape[0], cnt, *shape[1:]) for _ in range(3))
        jq, jk, jv = (_rand(b, shape[0], t, *shape[1:]) for _ in range(3))
    kw = dict(mesh=mesh, strategy=cfg.strategy, transport=cfg.transport, comm_sms=cfg.comm_sms)
    if cfg.strategy == "torus":
        kw["chunks"] = cfg.chunks
    if t > 0:
        kw.update(joint_q=jq, joint_k=jk, joint_v=jv)
    res = {}

    def step():
        res["o"] = sp.attention(q, k, v, **kw)

    def outputs():
        r = res["o"]
        if t > 0:
            out, joint = r
            return [(out, t + beg, cnt), (joint, 0, t)]
        return [(r, beg, cnt)]

    return step, outputs, None


# (impl, strategy) -> builder; a ditscale configuration is keyed by its impl alone.
LAYERS = {("single", "single"): single_layer, ("peer", "plain-ulysses"): plain_ulysses_layer,
          ("peer", "torch-cp"): torch_cp_layer}


def make_layer(b, cfg, seq: int, full: Optional[tuple] = None):
    """(step, outputs, close) of `cfg` at `seq` image tokens on the Bench `b`."""
    backend = b.backend_for.get(cfg.name, b.a.backend)
    build = ditscale_layer if cfg.impl == "ditscale" else LAYERS[(cfg.impl, cfg.strategy)]
    return build(b, cfg, seq, full, backend)
