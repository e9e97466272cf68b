"""ditscale.sp's one configuration (sp.Config, make_config, the environment overrides, the ranges
exported by C++, the one text encoding that C++ parses), the experiment variants kept out of it
(ditscale._experimental.sp_variants), the planning bindings of ditscale._core (keyword-only,
dicts, range errors, no torch or _C needed) and the configuration text of the GPU runtime's
torch ops (parsed before any GPU is touched)."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest

import ditscale.sp as sp
from ditscale import _core

LAYER = dict(batch=1, seq=16384, text=512, heads=24, head_dim=128)


@pytest.mark.parametrize("field,value,text", [
    ("ulysses_degree", -1, "ulysses_degree: -1 is out of range [0, 65536]"),
    ("ring_degree", 65537, "ring_degree: 65537 is out of range [0, 65536]"),
    ("chunks", 0, "chunks: 0 is out of range [1, 4096]"),
    ("ulysses_chunks", 4097, "ulysses_chunks: 4097 is out of range [1, 4096]"),
    ("comm_sms", -4, "comm_sms: -4 is out of range [0, 4096]"),
])
def test_config_numbers_have_ranges(field, value, text):
    strategy = {"ulysses_chunks": "ulysses", "chunks": "torus"}.get(field, "ring")
    with pytest.raises(ValueError) as e:
        sp.Config(strategy=strategy, **{field: value})
    assert text in str(e.value)


@pytest.mark.parametrize("value", [True, 1.5, "2", 2.0])
def test_config_numbers_must_be_integers(value):
    with pytest.raises(TypeError, match="chunks: expected an integer"):
        sp.Config(strategy="torus", chunks=value)


@pytest.mark.parametrize("field,value", [
    ("strategy", "torrus"), ("transport", "udp"),
])
def test_config_names_have_choices(field, value):
    with pytest.raises(ValueError, match=f"{field}: '{value}' is not one of"):
        sp.Config(**{field: value})


def test_config_refuses_fields_that_do_not_apply():
    with pytest.raises(ValueError, match="chunks: chosen by the planner under strategy='auto'"):
        sp.Config(chunks=2)
    with pytest.raises(ValueError, match="ulysses_degree, ring_degree: chosen by the planner"):
        sp.Config(ulysses_degree=2, ring_degree=2)
    with pytest.raises(ValueError,
                       match="chunks: 2 token chunks need strategy 'torus', not 'ring'"):
        sp.Config(strategy="ring", chunks=2)
    with pytest.raises(ValueError, match=r"ulysses head chunks: ulysses_chunks"):
        sp.Config(strategy="ulysses", chunks=2)
    with pytest.raises(ValueError, match="ulysses_chunks: 2 head chunks need strategy 'ulysses'"):
        sp.Config(strategy="torus", ulysses_chunks=2)
    assert sp.Config(strategy="torus").torus_chunks == 2
    assert sp.Config(strategy="ring").torus_chunks == 1
    assert sp.Config(strategy="torus", chunks=4).replace(chunks=1).torus_chunks == 1
    with pytest.raises(ValueError, match="topology: 'a;b' is not a preset name or a file"):
        sp.Config(topology="a;b")


def test_config_keeps_only_what_a_user_chooses():
    fields = [f.name for f in dataclasses.fields(sp.Config)]
    assert fields == ["strategy", "ulysses_degree", "ring_degree", "chunks", "ulysses_chunks",
                      "transport", "comm_sms", "topology"]
    for knob in ("engine", "signal", "net_channels_per_peer"):
        with pytest.raises(TypeError):
            sp.Config(**{knob: None})
    assert not hasattr(sp, "run_local") and not hasattr(sp, "ENGINES")


def test_ranges_and_names_come_from_cpp():
    got = _core.sp_config_fields()
    assert sp.config.RANGES == {"ulysses_degree": (0, 65536), "ring_degree": (0, 65536),
                                "chunks": (1, 4096), "ulysses_chunks": (1, 4096),
                                "comm_sms": (0, 4096)} == {k: tuple(v) for k, v in
                                                           got["ranges"].items()}
    assert sp.STRATEGIES == tuple(got["strategies"]) == tuple(_core.sp_strategies())
    assert sp.TRANSPORTS == ("nccl", "nvshmem", "nvshmem-intra") == tuple(got["transports"])


@pytest.mark.parametrize("cfg", [
    sp.Config(strategy="torus", chunks=3, topology="p4de", comm_sms=4),
    sp.Config(strategy="torus"),
    sp.Config(strategy="ulysses", ulysses_chunks=2, transport="nvshmem-intra", comm_sms=0),
    sp.Config(strategy="usp", ulysses_degree=2, ring_degree=2, comm_sms=0),
])
def test_one_text_encoding_read_by_python_and_cpp(cfg):
    cfg = sp.make_config("t", cfg)
    text = sp.config.config_text(cfg)
    back = sp.config.config_of_text(text)
    assert sp.config.config_text(back) == text
    assert (back.strategy, back.torus_chunks, back.ulysses_chunks, back.comm_sms) == (
        cfg.strategy, cfg.torus_chunks, cfg.ulysses_chunks, cfg.comm_sms)
    parsed = _core.sp_parse_config(text)
    assert parsed == {"strategy": cfg.strategy, "transport": cfg.transport,
                      "ulysses_degree": cfg.ulysses_degree, "ring_degree": cfg.ring_degree,
                      "chunks": cfg.torus_chunks, "ulysses_chunks": cfg.ulysses_chunks,
                      "comm_sms": cfg.comm_sms, "topology": cfg.topology}
    assert sp.config.resolved_text(cfg) == text


def test_text_encoding_errors_name_the_entry():
    auto = sp.config.config_text(sp.make_config("t"))
    assert "strategy=auto" in auto and "chunks=auto" in auto and "comm_sms=auto" in auto
    assert sp.config.config_of_text(auto) == sp.make_config("t")
    with pytest.raises(ValueError, match="config 'strategy=1'"):
        sp.config.config_of_text("strategy=1")
    good = sp.config.config_text(sp.make_config("t", strategy="ring"))
    for text, why in ((good + ";extra=1", "config: unknown key 'extra'"),
                      (good.replace("chunks=1", "chunks=1x"), "chunks: '1x' is not an integer"),
                      (good.replace("ring_degree=0", "ring_degree=-1"),
                       "ring_degree: -1 is out of range [0, 65536]"),
                      (good.replace("comm_sms=0;", ""), "config: the key 'comm_sms' is missing"),
                      (good + ";comm_sms=1", "config: the key 'comm_sms' is given twice"),
                      (good + ";oops", "config: entry 'oops' is not key=value"),
                      (auto, "chunks: 'auto' is not an integer")):
        with pytest.raises(_core.Error, match=re.escape(why)):
            _core.sp_parse_config(text)


def test_experiment_variants_live_apart(monkeypatch):
    from ditscale._experimental import sp_variants as v
    for name in (v.ENV_ENGINE, v.ENV_SIGNAL, v.ENV_NET_CHANNELS):
        monkeypatch.delenv(name, raising=False)
    assert v.current() == v.Variant() == v.Variant("auto", "write", 0)
    monkeypatch.setenv(v.ENV_ENGINE, "nvshmem")
    monkeypatch.setenv(v.ENV_SIGNAL, "copy")
    monkeypatch.setenv(v.ENV_NET_CHANNELS, "8")
    assert v.current() == v.Variant("nvshmem", "copy", 8)
    assert v.current().op_text() == "engine=nvshmem;signal=copy"
    v.set_current(v.Variant(engine="copy-engine"))
    try:
        assert v.current() == v.Variant("copy-engine", "write", 0)
    finally:
        v.set_current(None)
    for name, bad, text in (
            (v.ENV_ENGINE, "dma",
             "$DITSCALE_SP_ONE_SIDED_ENGINE: 'dma' is not one of auto, copy-engine, nvshmem"),
            (v.ENV_SIGNAL, "smoke", "$DITSCALE_SP_CE_SIGNAL: 'smoke' is not one of"),
            (v.ENV_NET_CHANNELS, "65",
             "$DITSCALE_SP_NET_CHANNELS_PER_PEER: 65 is out of range [0, 64]"),
            (v.ENV_NET_CHANNELS, "x", "$DITSCALE_SP_NET_CHANNELS_PER_PEER: 'x' is not an")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=re.escape(text)):
            v.current()
        monkeypatch.delenv(name)
    for field, bad in (("engine", "dma"), ("signal", "smoke"), ("net_channels_per_peer", 65)):
        with pytest.raises(ValueError, match=field):
            v.Variant(**{field: bad})


def test_make_config_applies_overrides_and_names_the_caller():
    base = sp.Config(strategy="torus", chunks=4, transport="nvshmem-intra")
    cfg = sp.make_config("f", base, chunks=None, comm_sms=4)
    assert (cfg.strategy, cfg.chunks, cfg.transport, cfg.comm_sms) == (
        "torus", 4, "nvshmem-intra", 4)
    assert sp.make_config("f", base, strategy="ring", chunks=1).torus_chunks == 1
    # No compatibility shim: Ulysses' head chunks are ulysses_chunks, never chunks.
    with pytest.raises(ValueError, match="f: chunks: 3 token chunks need strategy 'torus'"):
        sp.make_config("f", strategy="ulysses", chunks=3)
    with pytest.raises(ValueError, match=r"^ditscale\.sp\.plan: comm_sms: -1 is out of range"):
        sp.make_config("ditscale.sp.plan", strategy="ring", comm_sms=-1)
    with pytest.raises(TypeError, match="config must be a ditscale.sp.Config, got dict"):
        sp.make_config("f", {"strategy": "ring"})


def test_environment_fills_unset_fields_only(monkeypatch):
    for name in ("DITSCALE_SP_TOPOLOGY", "DITSCALE_SP_COMM_SMS"):
        monkeypatch.delenv(name, raising=False)
    d = sp.make_config("f", strategy="ring")
    assert (d.topology, d.comm_sms) == ("h200-local", 0)
    monkeypatch.setenv("DITSCALE_SP_TOPOLOGY", "p4de")
    monkeypatch.setenv("DITSCALE_SP_COMM_SMS", "2")
    assert (lambda e: (e.topology, e.comm_sms))(sp.make_config("f", strategy="ring")) == (
        "p4de", 2)
    x = sp.make_config("f", sp.Config(strategy="ring", comm_sms=1), topology="h200-local")
    assert (x.topology, x.comm_sms) == ("h200-local", 1)
    monkeypatch.setenv("DITSCALE_SP_COMM_SMS", "4097")
    with pytest.raises(ValueError) as err:
        sp.make_config("ditscale.sp.attention", strategy="ring")
    assert "ditscale.sp.attention: $DITSCALE_SP_COMM_SMS: 4097 is out of range" in str(err.value)


def test_plan_and_predict_take_one_config():
    cfg = sp.Config(strategy="torus", chunks=2, topology="p4de")
    mesh = sp.Mesh(2, 2)
    a = sp.predict(mesh, config=cfg, **LAYER)
    b = sp.predict(mesh, strategy="torus", chunks=2, topology="p4de", **LAYER)
    assert a == b > 0
    assert sp.predict(mesh, config=cfg, chunks=4, **LAYER) != a  # an override
    ranked = sp.plan(mesh, config=cfg, one_sided=False, **LAYER)["ranked"]
    assert {c["strategy"] for c in ranked} == {"torus"}  # the config's strategy
    cand = sp.predict_candidate(mesh, config=cfg, **LAYER)
    assert cand["strategy"] == "torus" and cand["predicted_layer_s"] == a
    with pytest.raises(ValueError, match="predict: strategy: 'auto' is not a configuration"):
        sp.predict(mesh, **LAYER)
    with pytest.raises(ValueError, match=r"plan: seq: 0 is out of range \[1, 1099511627776\]"):
        sp.plan(mesh, **dict(LAYER, seq=0))
    with pytest.raises(ValueError, match="plan: strategies: 'rings' is not one of"):
        sp.plan(mesh, strategies=["rings"], **LAYER)
    with pytest.raises(TypeError, match="Mesh: machines: expected an integer"):
        sp.Mesh(1.5, 2)


def test_core_planning_bindings_are_keyword_only_dicts():
    kw = dict(machines=2, gpus_per_machine=2, topology="h200-local", **LAYER)
    r = _core.sp_plan(one_sided=False, **kw)
    assert isinstance(r, dict) and isinstance(r["ranked"], list)
    assert isinstance(r["ranked"][0], dict) and isinstance(r["explanation"], str)
    ring = sp.make_config("t", strategy="ring", topology="h200-local")
    pkw = dict(machines=2, gpus_per_machine=2, **LAYER)
    c = _core.sp_predict(config=sp.config.config_text(ring), **pkw)
    assert isinstance(c, dict) and c["strategy"] == "ring" and c["predicted_layer_s"] > 0
    with pytest.raises(TypeError):
        _core.sp_predict(2, 2, 1, 16384, 512, 24, 0, 128, 2, sp.config.config_text(ring))
    for field, value, text in (("heads", 0, "heads: 0 is out of range [1, 65536]"),
                               ("head_dim", 8192, "head_dim: 8192 is out of range [1, 4096]"),
                               ("machines", 0, "machines: 0 is out of range [1, 65536]")):
        with pytest.raises(_core.Error) as e:
            _core.sp_predict(config=sp.config.config_text(ring), **dict(pkw, **{field: value}))
        assert text in str(e.value)
    text = sp.config.config_text(ring)
    for bad, why in ((text.replace("comm_sms=0", "comm_sms=-1"),
                      "comm_sms: -1 is out of range [0, 4096]"),
                     (text.replace("strategy=ring", "strategy=rong"),
                      "strategy: 'rong' is not one of"),
                     (text.replace("transport=nccl", "transport=shm"),
                      "transport: 'shm' is not one of"),
                     (text.replace("h200-local", "no-such-cluster"),
                      "topology 'no-such-cluster'"),
                     (text.replace(";topology=h200-local", ""),
                      "config: the key 'topology' is missing")):
        with pytest.raises(_core.Error) as e:
            _core.sp_predict(config=bad, **pkw)
        assert why in str(e.value)
    with pytest.raises(_core.Error, match="strategy: 'rong' is not one of"):
        _core.sp_plan(one_sided=False, strategies=["rong"], **kw)


def test_planning_needs_neither_torch_nor_the_extension():
    """plan, predict and the Config in a process where torch (and so ditscale._C) cannot be
    imported."""
    code = """
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError
import ditscale.sp as sp
r = sp.plan(sp.Mesh(2, 2), batch=1, seq=16384, text=512, heads=24, head_dim=128)
t = sp.predict(sp.Mesh(2, 2), config=sp.Config(strategy="torus"), batch=1, seq=16384,
               text=512, heads=24, head_dim=128)
assert r["ranked"] and t > 0
assert all(not c["one_sided"] for c in r["ranked"])  # no NVSHMEM without the extension
assert not {"ditscale.sp.api", "ditscale.sp.gpu_runtime", "ditscale.ops",
            "ditscale._extension"} & set(sys.modules)
try:
    sp.attention
except ImportError:
    pass
else:
    raise AssertionError("sp.attention imported without torch")
print("planned", len(r["ranked"]))
"""
    env = dict(os.environ, DITSCALE_EXT_PATH="/nonexistent/_C.so")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("planned ")


def _runtime_ops():
    import torch

    import ditscale.ops as ops
    if not ops.is_available() or not hasattr(torch.ops.ditscale, "sp_replay_compute"):
        pytest.skip("ditscale._C without the CUDA sequence-parallel runtime")
    return torch.ops.ditscale


def test_runtime_ops_parse_the_config_text_first():
    ops = _runtime_ops()
    from ditscale.sp.gpu_runtime import run_text
    text = run_text(sp.make_config("t", strategy="torus", chunks=2))
    assert text.endswith(";engine=auto;signal=write")
    good = dict(item.split("=", 1) for item in text.split(";"))
    assert set(good) == {"strategy", "transport", "ulysses_degree", "ring_degree", "chunks",
                         "ulysses_chunks", "comm_sms", "topology", "engine", "signal"}

    def as_text(fields):
        return ";".join(f"{k}={v}" for k, v in fields.items())

    def replay(fields, **kw):
        args = dict(machines=2, gpus_per_machine=2, rank=0, batch=1, seq=1024, text=0, heads=8,
                    kv_heads=0, head_dim=64, iters=1, warmup=0)
        args.update(kw)
        return ops.sp_replay_compute(as_text(fields), *args.values())

    for fields, text in (
            (dict(good, extra="1"), "config: unknown key 'extra'"),
            ({k: v for k, v in good.items() if k != "signal"},
             "config: the key 'signal' is missing"),
            ({k: v for k, v in good.items() if k != "comm_sms"},
             "config: the key 'comm_sms' is missing"),
            (dict(good, chunks="2x"), "chunks: '2x' is not an integer"),
            (dict(good, chunks=""), "chunks: '' is not an integer"),
            (dict(good, chunks="0"), "chunks: 0 is out of range [1, 4096]"),
            (dict(good, comm_sms="-1"), "comm_sms: -1 is out of range [0, 4096]"),
            (dict(good, strategy="rong"), "strategy: 'rong' is not one of"),
            (dict(good, transport="shm"), "transport: 'shm' is not one of"),
            (dict(good, engine="dma"), "engine: 'dma' is not one of auto, copy-engine, nvshmem"),
            (dict(good, signal="smoke"), "signal: 'smoke' is not one of write, copy"),
            (dict(good, strategy="ulysses"), "chunks: ulysses cuts its head group")):
        with pytest.raises(RuntimeError) as e:
            replay(fields)
        assert "ditscale.sp.replay_compute: " + text in str(e.value)
    with pytest.raises(RuntimeError, match="machines: 0 is out of range"):
        replay(good, machines=0)
    import torch
    if not torch.cuda.is_available():  # the dict parsed: the op got as far as the GPU
        with pytest.raises(RuntimeError, match="replay_compute: no CUDA device"):
            replay(good)
