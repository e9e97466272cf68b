"""examples/generate.py on the CPU, one process: a tiny image pipeline (SD3, PNG) and a tiny
video pipeline (Wan 2.1, MP4) of 2 steps run as scripts (concurrently) and write files of the
requested shapes; the option checks name the option, its value and its range."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
imageio = pytest.importorskip("imageio")

import ditscale  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "generate.py")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    package_dir = os.path.dirname(os.path.dirname(ditscale.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_dir, env.get("PYTHONPATH")) if p)
    return env


def test_generate_writes_an_image_and_a_video(tmp_path):
    runs = {"sd3": tmp_path / "image.png", "wan": tmp_path / "video.mp4"}
    procs = {name: subprocess.Popen(
        [sys.executable, SCRIPT, "--device", "cpu", "--pipeline", name, "--size", "tiny",
         "--steps", "2", "--seed", "1", "--out", str(out)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, out in runs.items()}
    logs = {}
    try:
        for name, proc in procs.items():
            logs[name] = proc.communicate(timeout=150)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, proc in procs.items():
        assert proc.returncode == 0, logs[name]
        assert "step 1/2:" in logs[name] and "step 2/2:" in logs[name], logs[name]
        assert "ms per step" in logs[name] and "s in total" in logs[name], logs[name]
    from PIL import Image

    with Image.open(runs["sd3"]) as image:
        assert image.format == "PNG" and image.size == (20, 12)  # (width, height)
    frames = imageio.mimread(runs["wan"])
    assert len(frames) == 9 and frames[0].shape == (48, 16, 3), (len(frames), frames[0].shape)


def _example():
    spec = importlib.util.spec_from_file_location("generate_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: 0 is out of range [1, 1000]"),
    (["--height", "4"], "--height: 4 is out of range [8, 16384]"),
    (["--guidance", "nan"], "--guidance: nan is out of range [0, 100]"),
    (["--seed", "-1"], "--seed: -1 is out of range"),
    (["--pipeline", "flux", "--frames", "5"], "--frames: 5 is out of range [1, 1]"),
    (["--pipeline", "wan", "--frames", "2000"], "--frames: 2000 is out of range [1, 1025]"),
    (["--fps", "0"], "--fps: 0 is out of range [1, 240]"),
    (["--text-tokens", "0"], "--text-tokens: 0 is out of range [1, 4096]"),
    (["--pipeline", "wan", "--out", "x.png"], "--out: 'x.png': a video pipeline writes .mp4"),
    (["--pipeline", "sd3", "--out", "x.mp4"], "--out: 'x.mp4': an image pipeline writes .png"),
])
def test_options_are_range_checked(argv, message):
    with pytest.raises(ValueError) as info:
        _example().parse_args(["--device", "cpu"] + argv)
    assert message in str(info.value)


def test_defaults_follow_the_pipeline_and_size():
    args = _example().parse_args(["--device", "cpu", "--pipeline", "cogvideox"])
    assert (args.height, args.width, args.frames, args.steps) == (24, 8, 9, 2)
    assert args.guidance == 6.0 and args.out == "generate-cogvideox.mp4"
    assert args.dtype == "float32" and args.text_tokens == 7


def test_missing_weights_folder_is_named(tmp_path):
    from ditscale.diffusers import tiny

    missing = tmp_path / "nothing-here"
    with pytest.raises(ValueError, match="nothing-here.*does not exist"):
        tiny.load_pipeline("flux", str(missing))
    with pytest.raises(ValueError, match="has no model_index.json"):
        tiny.load_pipeline("flux", str(tmp_path))
    (tmp_path / "model_index.json").write_text(  # a checkpoint whose components are missing
        '{"_class_name": "FluxPipeline", "scheduler": ["diffusers", '
        '"FlowMatchEulerDiscreteScheduler"], "transformer": ["diffusers", '
        '"FluxTransformer2DModel"]}')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*cannot load a FluxPipeline"):
        tiny.load_pipeline("flux", str(tmp_path))
