"""The diffusers benchmarks' command lines (bench/diffusers/cli.py) and model table, without a
GPU: ranges refused with their names, the patched grids of the token counts."""

import json

import pytest

pytest.importorskip("diffusers")

from bench.diffusers import adaln_models, models, sp_overhead  # noqa: E402


@pytest.mark.parametrize("mod", [adaln_models, sp_overhead])
@pytest.mark.parametrize("argv,needle", [
    (["--blocks", "0"], "--blocks: 0 is out of range [1, 64]"),
    (["--reps", "2"], "--reps: 2 is out of range [3, 1000]"),
    (["--max-s", "0"], "--max-s: 0.0 is out of range (0, 600]"),
    (["--models", "flux,nope"], "--models: ['nope']"),
    (["--tokens", "0"], "--tokens: [0] must be in [1, 1048576]"),
    (["--tokens", "x"], "--tokens: 'x' is not"),
    (["--modes", "fast"], "--modes: ['fast']"),
])
def test_bad_options_are_named(mod, argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        mod.parse(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_defaults_parse():
    a = adaln_models.parse([])
    assert a.models == ["wan2.1-1.3b", "wan2.1-14b", "flux"] and a.sdpa == "flash"
    assert sp_overhead.parse(["--tokens", "4096"]).tokens == [4096]


@pytest.mark.parametrize("tokens", [1024, 4096, 32760, 75600, 17550, 16384, 4099])
def test_grids_hold_exactly_the_tokens(tokens):
    for frames_first in (True, False):
        f, h, w = models._grid(tokens, frames_first)
        assert f * h * w == tokens


def test_sweep_keeps_rows_after_a_failed_pair(capsys):
    from bench.diffusers import cli

    args = adaln_models.parse(["--models", "flux,wan2.1-1.3b", "--tokens", "8", "--modes",
                               "eager,compile"])

    def compare(name, tokens, compiled):
        if name == "flux" and compiled:
            raise RuntimeError("boom")
        return {"ms": 1.0 + compiled}, f"ms {1 + compiled}"

    rows = cli.sweep("t", args, models.TOKENS, compare)
    assert [(r["model"], r["mode"]) for r in rows] == [
        ("flux", "eager"), ("flux", "compile"), ("wan2.1-1.3b", "eager"),
        ("wan2.1-1.3b", "compile")]
    assert rows[1]["error"] == "RuntimeError: boom" and "ms" not in rows[1]
    assert rows[3]["ms"] == 2.0 and rows[0]["blocks"] == 4
    out = capsys.readouterr()
    assert "[t] flux 8 compile: RuntimeError: boom" in out.err
    assert "[t] wan2.1-1.3b      8 compile ms 2" in out.out
    line = cli.error_line(rows[1], 7)
    assert line == "| flux | 8 | compile | error: RuntimeError: boom | | | |"
    assert sp_overhead.table(rows[1:2]).splitlines()[-1] == line


class _Kernel:
    def __init__(self, start, end, name):
        self.time_range = type("R", (), {"start": start, "end": end})()
        self.name = name


def test_idle_gaps_count_time_when_no_kernel_runs():
    from bench.diffusers.timing import idle_gaps

    # a [0, 10], b [5, 20] (overlapping on a second stream), c [50, 60], d [61, 100]: busy 20 +
    # 10 + 39 = 69 of a 100 us span -> 31 us idle in 2 gaps (30 us b -> c, 1 us c -> d).
    ks = [_Kernel(50, 60, "c"), _Kernel(0, 10, "a"), _Kernel(61, 100, "d"), _Kernel(5, 20, "b")]
    out = idle_gaps(ks, steps=1)
    assert out["idle"] == pytest.approx(0.031)
    assert out["top_gaps"] == [(pytest.approx(0.030), "b", "c"), (pytest.approx(0.001), "c", "d")]
    assert idle_gaps(ks, steps=2)["idle"] == pytest.approx(0.0155)
    assert idle_gaps([], steps=1) == {"idle": 0.0, "top_gaps": []}


def test_marker_edges_measure_the_host_gaps_at_both_ends_of_a_step():
    from bench.diffusers.timing import marker_edges

    spans = [(0, 10, "spin_kernel"), (40, 50, "gemm"), (55, 70, "adaln"), (100, 110, "spin_kernel"),
             (200, 210, "spin_kernel"), (230, 240, "gemm"), (250, 255, "spin_kernel")]
    out = marker_edges(spans)
    assert out["lead"] == pytest.approx((30 + 20) / 2 / 1e3)  # 10 -> 40, 210 -> 230
    assert out["tail"] == pytest.approx((30 + 10) / 2 / 1e3)  # 70 -> 100, 240 -> 250
    empty = marker_edges([(0, 10, "spin_kernel"), (25, 30, "spin_kernel")])
    assert empty == {"lead": pytest.approx(0.015), "tail": 0.0}
    with pytest.raises(ValueError, match="3 marker kernels"):
        marker_edges(spans[:4] + spans[4:5])


def test_gap_lists_name_the_fused_steps_own_kernels_and_gaps():
    from bench.diffusers.adaln_models import gap_lists

    row = {"model": "wan2.1-1.3b", "tokens": 32760, "mode": "compile",
           "fused_kernels": {"top_ours": [("adaln_bwd_pipe_kernel<bf16, 3, 3, false>", 1.25, 8)],
                             "top_gaps": [(0.5, "gemm", "adaln")]}}
    text = gap_lists([row])
    assert "ditscale kernels, fused wan2.1-1.3b 32760 compile" in text
    assert "- 1.250 ms x8: adaln_bwd_pipe_kernel<bf16, 3, 3, false>" in text
    assert "- 0.500 ms: gemm -> adaln" in text
    assert gap_lists([{**row, "fused_kernels": {}}]) == ""


def test_recording_backend_lists_what_the_forward_saves():
    """saved_tensors' backend on y = sin(2x) @ w: the partitioner hands the backward sin's output
    (transposed, for w's gradient; cos(2x) is recomputed from x); neither the output [8, 3] nor
    the graph inputs x and w (nor w's transpose, a view of an input) are listed, and the compiled
    function computes the eager result."""
    import torch

    from bench.diffusers import saved_tensors

    saved, graphs = [], []
    fn = torch.compile(lambda x, w: (x * 2).sin() @ w,
                       backend=saved_tensors._recording_backend(saved, graphs))
    x = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    out = fn(x, w)
    assert torch.allclose(out, (x * 2).sin() @ w)
    out.sum().backward()
    torch._dynamo.reset()
    assert graphs and len(graphs) == 1
    assert saved == [("t(sin)", (4, 8), "float32", 128)], saved


def test_written_tables_start_with_the_reporter_header(tmp_path, capsys):
    from bench.diffusers import cli

    rows = [{"model": "flux", "tokens": 8, "mode": "eager", "ms": 1.0}]
    assert cli.write(str(tmp_path), "t", rows, "| a |\n|---|\n| 1 |\n", "A title") == 0
    md = (tmp_path / "t.md").read_text().splitlines()
    assert md[0] == "# A title" and md[2].startswith("- device: ")
    assert any(line.startswith("- commit: ") for line in md) and md[-1] == "| 1 |"
    assert json.loads((tmp_path / "t.json").read_text()) == rows
    rows.append({"model": "wan", "tokens": 8, "mode": "eager", "error": "boom"})
    assert cli.write(str(tmp_path), "t", rows, "", "A title") == 1
