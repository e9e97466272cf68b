"""CPU tests of bench/sp/fit_runs.py (the package `bench` of the repository root, on the path
through pyproject.toml's pytest `pythonpath`): on "measurements" made by the simulator itself
with a known compute-rate offset, bandwidth scale and compute interference, the fit recovers
them, the held-out predictions match, report.py renders the section, and bad input is refused
with the file named."""

import json
from pathlib import Path

import pytest

from bench.common import find_cli
from bench.sp import fit_runs, report

CLI = find_cli()
pytestmark = pytest.mark.skipif(CLI is None, reason="the ditscale CLI is not built")

TOPOLOGY = {"base": "h200-local", "name": "synthetic", "gpus_per_machine": 1,
            "nic_bandwidth_GBps": 3.0, "nic_duplex_GBps": 4.0, "attention_tflops": 600.0,
            "attention_slots": 132}
SEQS = (4096, 8192)
CONFIGS = (("ulysses", 1), ("ring", 1), ("torus", 2))


def _run(seq, config, impl, strategy, ms, mesh, chunks=1):
    return {"seq": seq, "text": 512, "config": config, "impl": impl, "strategy": strategy,
            "chunks": chunks, "transport": "nccl", "mesh": list(mesh), "link": "emulated",
            "status": "ok", "ms": ms}


def _launch(calib: Path, anchor: float, scale: float, f: float) -> dict:
    """An emulated-machine launch whose times the simulator predicts with these parameters
    (the one-GPU runs 1/anchor slower than the calibration's rate)."""
    sim = fit_runs.Sim(CLI, calib, "emulated")
    runs = []
    for seq in SEQS:
        one = _run(seq, "1 GPU (SDPA)", "single", "single", 0, (1, 1))
        one["ms"] = sim.ms(one, (1.0, 1.0, 0.0)) / anchor
        runs.append(one)
        for strategy, chunks in CONFIGS:
            r = _run(seq, f"ditscale {strategy} c{chunks} nccl", "ditscale", strategy, 0, (2, 1),
                     chunks)
            r["ms"] = sim.ms(r, (anchor, scale, f))
            runs.append(r)
    return {"kind": "ditscale-sp-attention-bench", "version": 1, "link": "emulated",
            "emulate_machines": 2, "world_size": 2, "host": "test", "gpu": "NVIDIA H200",
            "torch": "2.11.0", "nccl": "2.28.9", "ditscale_sp": True, "ditscale_sp_error": "",
            "shape": {"batch": 1, "text": 512, "heads": 24, "head_dim": 128, "dtype": "bf16",
                      "causal": False},
            "timing": {"warmup": 1, "iters": 2, "repeats": 2, "statistic": "median"},
            "runs": runs, "checks": {}}


@pytest.fixture()
def small_grid(monkeypatch):
    monkeypatch.setattr(fit_runs, "F_GRID", [0.0, 0.2, 0.4, 0.6])
    monkeypatch.setattr(fit_runs, "S_GRID", [0.8, 0.9, 1.0, 1.1])


def test_fit_recovers_known_parameters_and_report_renders_them(tmp_path, small_grid):
    calib = tmp_path / "calib"
    calib.mkdir()
    (calib / "topology-h200.json").write_text(json.dumps(TOPOLOGY))
    anchor = 0.95  # the benchmark's GPU 5% slower than the calibration call's
    doc = _launch(calib, anchor, 0.9, 0.4)
    (tmp_path / "emu.json").write_text(json.dumps(doc))
    assert fit_runs.main([str(tmp_path / "emu.json"), "--calib-dir", str(calib)]) == 0
    out = json.loads((calib / "fit-runs.json").read_text())
    (launch,) = out["launches"]
    assert launch["anchor"]["attention_scale"] == pytest.approx(anchor, abs=2e-3)
    lf = launch["link_fit"]
    assert lf["bandwidth_scale"] == pytest.approx(0.9, abs=0.02)
    assert lf["interference"] == pytest.approx(0.4, abs=0.06)
    assert set(lf["held_out"]) == {str(s) for s in SEQS}
    st = launch["stats"]
    assert st["fitted"]["n"] == st["held_out"]["n"] == len(SEQS) * len(CONFIGS)
    assert st["fitted"]["rms_log"] < 0.01 and st["held_out"]["rms_log"] < 0.02
    # Without the link fit the overlapped forms are predicted too fast: the fit must matter.
    assert st["calibration"]["max"] > 1.05
    topo = json.loads((calib / "topology-h200-emulated-fitted.json").read_text())
    assert topo["inter_compute_interference"] == lf["interference"]
    assert topo["nic_bandwidth_GBps"] == pytest.approx(3.0 * lf["bandwidth_scale"])
    assert topo["attention_tflops"] == pytest.approx(600.0 * anchor, rel=3e-3)
    # report.py shows the section for this launch (and not for a launch it was not given).
    md = tmp_path / "sp.md"
    assert report.main([str(tmp_path / "emu.json"), "--calib-dir", str(calib), "--out",
                        str(md), "--no-png"]) == 0
    text = md.read_text()
    assert "## Simulator fitted to the runs" in text
    assert "| ditscale torus c2 nccl | 8,192 | 2x1 |" in text
    other = dict(doc, link="emulated")
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert report.main([str(tmp_path / "other.json"), "--calib-dir", str(calib), "--out",
                        str(md), "--no-png"]) == 0
    assert "## Simulator fitted to the runs" not in md.read_text()


def test_bad_input_names_the_file_and_field(tmp_path, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    (calib / "topology-h200.json").write_text(json.dumps(TOPOLOGY))
    foreign = {"kind": "something-else", "runs": []}
    (tmp_path / "bad.json").write_text(json.dumps(foreign))
    assert fit_runs.main([str(tmp_path / "bad.json"), "--calib-dir", str(calib)]) == 2
    assert "'kind'" in capsys.readouterr().err
    bad = {"kind": "ditscale-sp-attention-bench", "link": "emulated", "shape": {"text": 77, "heads": 24, "head_dim": 128}, "runs": []}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert fit_runs.main([str(tmp_path / "bad.json"), "--calib-dir", str(calib)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "'shape'" in err
    flux = dict(bad, shape={"text": 512, "heads": 24, "head_dim": 128}, link="infiniband")
    (tmp_path / "bad.json").write_text(json.dumps(flux))
    assert fit_runs.main([str(tmp_path / "bad.json"), "--calib-dir", str(calib)]) == 2
    assert "'link'" in capsys.readouterr().err
    no_single = dict(flux, link="emulated", runs=[_run(4096, "x", "ditscale", "ring", 5.0, (2, 1))])
    (tmp_path / "bad.json").write_text(json.dumps(no_single))
    assert fit_runs.main([str(tmp_path / "bad.json"), "--calib-dir", str(calib)]) == 2
    assert "one-GPU run" in capsys.readouterr().err
    assert fit_runs.main([str(tmp_path / "bad.json"), "--calib-dir", str(tmp_path)]) == 2
    assert "topology-h200.json" in capsys.readouterr().err
