"""The Flux-like MMDiT of ditscale.models.mmdit, its diffusers loader and the SP example (CPU)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from ditscale.models.mmdit import (  # noqa: E402
    FluxMMDiT,
    apply_rope_pairs,
    build_mmdit,
    gather_tokens,
    image_ids,
    make_mmdit_config,
    pack_latents,
    rope_tables,
    sdpa_joint_attention,
    shard_range,
    shard_tokens,
    text_ids,
    unpack_latents,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny(**kw):
    return make_mmdit_config("tiny", **kw)


def make_inputs(cfg, gh, gw, seed=1, batch=1):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(batch, cfg.latent_channels, 2 * gh, 2 * gw, generator=g)
    return {
        "img": pack_latents(lat),
        "img_ids": image_ids(gh, gw),
        "text": torch.randn(batch, cfg.text_len, cfg.text_dim, generator=g),
        "pooled": torch.randn(batch, cfg.pooled_dim, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "guidance": torch.full((batch,), 3.5),
    }


def run(model, inp, **kw):
    with torch.no_grad():
        return model(**{**inp, **kw})


# ---------------------------------------------------------------------------------------------
# Names and shapes: diffusers' FluxTransformer2DModel layout, written out by hand.


def diffusers_keys(d, heads_dim, mlp, in_ch, text_dim, pooled, freq=256, guidance=True):
    lin = lambda name, o, i: {f"{name}.weight": (o, i), f"{name}.bias": (o,)}  # noqa: E731
    keys = {}
    keys.update(lin("x_embedder", d, in_ch))
    keys.update(lin("context_embedder", d, text_dim))
    keys.update(lin("time_text_embed.timestep_embedder.linear_1", d, freq))
    keys.update(lin("time_text_embed.timestep_embedder.linear_2", d, d))
    if guidance:
        keys.update(lin("time_text_embed.guidance_embedder.linear_1", d, freq))
        keys.update(lin("time_text_embed.guidance_embedder.linear_2", d, d))
    keys.update(lin("time_text_embed.text_embedder.linear_1", d, pooled))
    keys.update(lin("time_text_embed.text_embedder.linear_2", d, d))
    b = "transformer_blocks.0"
    keys.update(lin(f"{b}.norm1.linear", 6 * d, d))
    keys.update(lin(f"{b}.norm1_context.linear", 6 * d, d))
    for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0",
              "to_add_out"):
        keys.update(lin(f"{b}.attn.{p}", d, d))
    for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        keys[f"{b}.attn.{n}.weight"] = (heads_dim,)
    for ff in ("ff", "ff_context"):
        keys.update(lin(f"{b}.{ff}.net.0.proj", mlp, d))
        keys.update(lin(f"{b}.{ff}.net.2", d, mlp))
    s = "single_transformer_blocks.0"
    keys.update(lin(f"{s}.norm.linear", 3 * d, d))
    keys.update(lin(f"{s}.proj_mlp", mlp, d))
    keys.update(lin(f"{s}.proj_out", d, d + mlp))
    for p in ("to_q", "to_k", "to_v"):
        keys.update(lin(f"{s}.attn.{p}", d, d))
    keys[f"{s}.attn.norm_q.weight"] = (heads_dim,)
    keys[f"{s}.attn.norm_k.weight"] = (heads_dim,)
    keys.update(lin("norm_out.linear", 2 * d, d))
    keys.update(lin("proj_out", in_ch, d))
    return keys


def test_param_names_and_shapes_match_diffusers():
    cfg = tiny(num_double=1, num_single=1)
    model = build_mmdit(cfg, seed=0)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = diffusers_keys(256, 64, 1024, 64, cfg.text_dim, cfg.pooled_dim)
    assert sorted(set(got) - set(want)) == [] and sorted(set(want) - set(got)) == []
    assert got == want
    schnell = build_mmdit(make_mmdit_config("tiny", num_double=1, num_single=1,
                                            guidance_embeds=False), seed=0)
    assert not any("guidance" in k for k in schnell.state_dict())


def test_flux_dev_config_is_the_real_size():
    cfg = make_mmdit_config("flux.1-dev")
    assert (cfg.num_double, cfg.num_single, cfg.hidden, cfg.num_heads, cfg.head_dim) == (
        19, 38, 3072, 24, 128)
    assert cfg.axes_dims == (16, 56, 56) and cfg.text_len == 512 and cfg.in_channels == 64
    with torch.device("meta"):
        model = FluxMMDiT(cfg)
    sd = model.state_dict()
    assert len(sd) == 1160 and abs(model.num_params() - 11.901e9) < 0.001e9
    assert tuple(sd["single_transformer_blocks.37.proj_out.weight"].shape) == (3072, 15360)
    assert tuple(sd["context_embedder.weight"].shape) == (3072, 4096)
    assert tuple(sd["time_text_embed.text_embedder.linear_1.weight"].shape) == (3072, 768)
    with pytest.raises(ValueError, match="axes_dims"):
        make_mmdit_config("tiny", axes_dims=(16, 16, 16))
    with pytest.raises(ValueError, match="unknown MMDiT"):
        make_mmdit_config("flux9")


def test_build_is_deterministic_and_dtype_independent():
    cfg = tiny()
    a, b = build_mmdit(cfg, seed=3), build_mmdit(cfg, seed=3)
    c = build_mmdit(cfg, dtype=torch.bfloat16, seed=3)
    for (k, x), y, z in zip(a.state_dict().items(), b.state_dict().values(),
                            c.state_dict().values()):
        assert torch.equal(x, y), k
        assert torch.equal(x.to(torch.bfloat16), z), k
    assert not torch.equal(a.x_embedder.weight, build_mmdit(cfg, seed=4).x_embedder.weight)


# ---------------------------------------------------------------------------------------------
# Ids, RoPE, packing, sharding.


def test_image_ids_and_rope_of_a_shard_equal_the_slice_of_the_full_ids():
    cfg = tiny()
    gh, gw = 5, 7
    ids = image_ids(gh, gw)
    assert ids.shape == (35, 3)
    assert torch.equal(ids[0], torch.tensor([0.0, 0, 0]))
    assert torch.equal(ids[8], torch.tensor([0.0, 1, 1]))  # row-major: token 8 = (1, 1)
    cos, sin = rope_tables(ids, cfg.axes_dims)
    for world in (2, 3, 4):
        covered = 0
        for r in range(world):
            begin, count = shard_range(35, world, r)
            assert begin == covered
            covered += count
            shard = shard_tokens(ids, r, world, dim=0)
            assert torch.equal(shard, ids[begin:begin + count])
            c, s = rope_tables(shard, cfg.axes_dims)
            assert torch.equal(c, cos[begin:begin + count])
            assert torch.equal(s, sin[begin:begin + count])
        assert covered == 35
    assert [shard_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 2), (5, 2)]
    # Text ids are zero: the rotation is the identity.
    c, s = rope_tables(text_ids(4), cfg.axes_dims)
    assert torch.equal(c, torch.ones_like(c)) and torch.equal(s, torch.zeros_like(s))


def test_rope_matches_the_complex_formulation():
    """diffusers' Flux RoPE: adjacent pairs as complex numbers times exp(i * id_a * freq)."""
    axes = (16, 24, 24)
    ids = image_ids(3, 4) + torch.tensor([2.0, 0, 0])
    x = torch.randn(2, 12, 3, 64, dtype=torch.float64)
    angles = []
    for a, d in enumerate(axes):
        freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles.append(ids[:, a].double()[:, None] * freq[None])
    rot = torch.polar(torch.ones(12, 32, dtype=torch.float64), torch.cat(angles, 1))
    want = torch.view_as_real(torch.view_as_complex(x.reshape(2, 12, 3, 32, 2))
                              * rot[None, :, None]).reshape(2, 12, 3, 64)
    got = apply_rope_pairs(x.float(), *rope_tables(ids, axes)).double()
    assert torch.allclose(got, want, atol=1e-5)


def test_pack_unpack_roundtrip_and_diffusers_order():
    lat = torch.randn(2, 16, 6, 8)
    tok = pack_latents(lat)
    assert tok.shape == (2, 12, 64)
    # Token (row 1, col 2) holds latents[:, c, 2:4, 4:6] flattened as (c, ph, pw).
    assert torch.equal(tok[:, 1 * 4 + 2], lat[:, :, 2:4, 4:6].reshape(2, 64))
    assert torch.equal(unpack_latents(tok, 3, 4), lat)
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.randn(1, 16, 5, 8))


def test_sdpa_joint_attention_is_dense_softmax_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    tq, tk, tv = (torch.randn(2, 4, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out, jout = sdpa_joint_attention(q, k, v, joint_q=tq, joint_k=tk, joint_v=tv)
    qq, kk, vv = torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1)
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", qq, kk) / 4.0, dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    assert torch.allclose(out, ref[:, 4:]) and torch.allclose(jout, ref[:, :4])


def test_forward_shapes_and_errors():
    cfg = tiny()
    model = build_mmdit(cfg, seed=0)
    inp = make_inputs(cfg, 4, 6, batch=2)
    out = run(model, inp)
    assert out.shape == (2, 24, 64) and torch.isfinite(out).all()
    assert out.std() > 0.1  # random non-zero gates: not the identity AdaLN-Zero init
    with pytest.raises(ValueError, match="guidance"):
        run(model, inp, guidance=None)
    with pytest.raises(ValueError, match="img_ids"):
        run(model, inp, img_ids=image_ids(4, 5))
    bf = build_mmdit(cfg, dtype=torch.bfloat16, seed=0)
    rel = (run(bf, inp).float() - out).abs().max() / out.abs().max()
    assert rel < 3e-2


# ---------------------------------------------------------------------------------------------
# Sequence parallelism on CPU: 2 gloo processes, each on its image shard.


def _allgather_kv_attention(q, k, v, joint_q, joint_k, joint_v, total):
    """Test reference: all-gather the image k/v, then dense attention over [text; image]."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    counts = [shard_range(total, world, r)[1] for r in range(world)]
    pad = max(counts)

    def gather(x):
        x = torch.cat([x, x.new_zeros(x.shape[0], pad - x.shape[1], *x.shape[2:])], 1)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        return torch.cat([p[:, :c] for p, c in zip(parts, counts)], 1)

    assert q.shape[1] == counts[rank]
    kk, vv = torch.cat([joint_k, gather(k)], 1), torch.cat([joint_v, gather(v)], 1)
    qq = torch.cat([joint_q, q], 1)
    o = F.scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2),
                                       vv.transpose(1, 2)).transpose(1, 2)
    t = joint_q.shape[1]
    return o[:, t:], o[:, :t]


def _local_only_attention(q, k, v, joint_q, joint_k, joint_v):
    return sdpa_joint_attention(q, k, v, joint_q=joint_q, joint_k=joint_k, joint_v=joint_v)


def _sp_worker(rank, world, port, grids, result_path):
    import functools

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = tiny()
        model = build_mmdit(cfg, seed=7)
        results = []
        for gh, gw in grids:
            inp = make_inputs(cfg, gh, gw, seed=gh * 100 + gw, batch=2)
            total = gh * gw
            ref = run(model, inp)
            local = {**inp, "img": shard_tokens(inp["img"], rank, world),
                     "img_ids": shard_tokens(inp["img_ids"], rank, world, dim=0)}
            attn = functools.partial(_allgather_kv_attention, total=total)
            out = gather_tokens(run(model, local, attn=attn), total)
            wrong = gather_tokens(run(model, local, attn=_local_only_attention), total)
            scale = ref.abs().max()
            results.append({"grid": [gh, gw], "local_tokens": local["img"].shape[1],
                            "err": float((out - ref).abs().max() / scale),
                            "wrong_err": float((wrong - ref).abs().max() / scale)})
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sequence_parallel_forward_matches_single_process(tmp_path):
    import torch.multiprocessing as mp

    grids = [(4, 6), (7, 9)]  # 24 tokens (12 + 12) and 63 tokens (32 + 31)
    path = str(tmp_path / "sp.json")
    mp.spawn(_sp_worker, args=(2, _free_port(), grids, path), nprocs=2, join=True)
    with open(path) as f:
        results = json.load(f)
    assert [r["local_tokens"] for r in results] == [12, 32]
    for r in results:
        assert r["err"] < 1e-5, r  # fp32: same math up to summation order
        assert r["wrong_err"] > 1e-2, r  # attention across shards matters (the check has teeth)


# ---------------------------------------------------------------------------------------------
# The diffusers safetensors loader.

def _save(tensors, path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def test_loader_single_file_equal_outputs(tmp_path):
    pytest.importorskip("safetensors")
    from ditscale.models.flux_weights import load_diffusers_flux

    cfg = tiny()
    src = build_mmdit(cfg, seed=11)
    _save(src.state_dict(), str(tmp_path / "diffusion_pytorch_model.safetensors"))
    dst = build_mmdit(cfg, seed=None)
    stats = load_diffusers_flux(dst, str(tmp_path))
    assert stats["tensors"] == len(src.state_dict()) and stats["files"] == 1
    inp = make_inputs(cfg, 3, 4)
    assert torch.equal(run(dst, inp), run(src, inp))
    # Cast to the model's dtype (a bf16 model from the fp32 file), loading the file directly.
    bf = build_mmdit(cfg, dtype=torch.bfloat16, seed=None)
    load_diffusers_flux(bf, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(bf.proj_out.weight, src.proj_out.weight.to(torch.bfloat16))


def test_loader_reports_missing_unexpected_and_shape_mismatch_together(tmp_path):
    pytest.importorskip("safetensors")
    from ditscale.models.flux_weights import FluxCheckpointError, load_diffusers_flux

    cfg = tiny()
    sd = dict(build_mmdit(cfg, seed=1).state_dict())
    del sd["transformer_blocks.1.attn.to_k.bias"]
    sd["transformer_blocks.0.attn.extra.weight"] = torch.zeros(3)
    sd["single_transformer_blocks.2.proj_mlp.weight"] = torch.zeros(1000, 256)
    path = str(tmp_path / "bad.safetensors")
    _save(sd, path)
    model = build_mmdit(cfg, seed=2)
    before = model.x_embedder.weight.clone()
    with pytest.raises(FluxCheckpointError) as e:
        load_diffusers_flux(model, path)
    msg = str(e.value)
    assert "3 problems" in msg and path in msg
    assert "missing key 'transformer_blocks.1.attn.to_k.bias'" in msg
    assert "unexpected key 'transformer_blocks.0.attn.extra.weight'" in msg
    assert ("shape mismatch for 'single_transformer_blocks.2.proj_mlp.weight'" in msg
            and "file (1000, 256), model (1024, 256)" in msg)
    assert torch.equal(model.x_embedder.weight, before)  # nothing loaded on failure


def test_loader_sharded_folder_with_index(tmp_path):
    pytest.importorskip("safetensors")
    from ditscale.models.flux_weights import FluxCheckpointError, load_diffusers_flux

    cfg = tiny()
    src = build_mmdit(cfg, seed=5)
    sd = src.state_dict()
    names = ["diffusion_pytorch_model-00001-of-00002.safetensors",
             "diffusion_pytorch_model-00002-of-00002.safetensors"]
    keys = list(sd)
    shards = {names[0]: keys[: len(keys) // 2], names[1]: keys[len(keys) // 2:]}
    for name, ks in shards.items():
        _save({k: sd[k] for k in ks}, str(tmp_path / name))
    index = {"metadata": {"total_size": 0},
             "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    # A pipeline folder: the transformer/ subfolder is found.
    pipe = tmp_path.parent / (tmp_path.name + "_pipe")
    pipe.mkdir()
    (pipe / "transformer").symlink_to(tmp_path, target_is_directory=True)
    for where in (tmp_path, pipe):
        dst = build_mmdit(cfg, seed=None)
        stats = load_diffusers_flux(dst, str(where))
        assert stats["files"] == 2 and stats["tensors"] == len(keys)
        inp = make_inputs(cfg, 4, 3)
        assert torch.equal(run(dst, inp), run(src, inp))
    # An index naming a shard that is not there.
    os.remove(tmp_path / names[1])
    with pytest.raises(FluxCheckpointError, match=f"shard file .*{names[1]}.* does not exist"):
        load_diffusers_flux(build_mmdit(cfg, seed=None), str(tmp_path))
    with pytest.raises(FluxCheckpointError, match="no such file"):
        load_diffusers_flux(build_mmdit(cfg, seed=None), str(tmp_path / "nope.safetensors"))


def test_matches_diffusers_flux_when_installed(tmp_path):
    """Parity with diffusers' own FluxTransformer2DModel (random weights loaded through our
    loader). Skipped where diffusers is not installed (it is not a dependency)."""
    pytest.importorskip("safetensors")
    diffusers = pytest.importorskip("diffusers")
    from ditscale.models.flux_weights import load_diffusers_flux

    cfg = tiny(num_double=2, num_single=3)
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=3, attention_head_dim=64,
        num_attention_heads=4, joint_attention_dim=cfg.text_dim,
        pooled_projection_dim=cfg.pooled_dim, guidance_embeds=True,
        axes_dims_rope=cfg.axes_dims).eval()
    with torch.no_grad():  # non-zero everywhere, so that every term is checked
        for p in ref.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
            if p.dim() == 1:  # norm weights and biases around 1
                p.add_(1.0)
    _save(ref.state_dict(), str(tmp_path / "diffusion_pytorch_model.safetensors"))
    mine = build_mmdit(cfg, seed=None)
    load_diffusers_flux(mine, str(tmp_path))
    inp = make_inputs(cfg, 5, 6)
    with torch.no_grad():
        want = ref(hidden_states=inp["img"], encoder_hidden_states=inp["text"],
                   pooled_projections=inp["pooled"], timestep=inp["timestep"],
                   img_ids=inp["img_ids"], txt_ids=text_ids(cfg.text_len),
                   guidance=inp["guidance"], return_dict=False)[0]
    got = run(mine, inp)
    assert (got - want).abs().max() / want.abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------
# The example.


def test_sp_inference_example_runs_on_cpu(tmp_path):
    out = tmp_path / "sp.json"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "sp_inference.py"), "--device", "cpu",
         "--tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert elapsed < 60, elapsed
    assert "single" in proc.stdout and "latency ms" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["strategy"] == "single" and rows[0]["tokens"] == 256
    assert rows[0]["latency_s"] > 0
