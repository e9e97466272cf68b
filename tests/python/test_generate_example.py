"""examples/generate.py on the CPU, one process: a tiny image pipeline (SD3, PNG) and a tiny
video pipeline (Wan 2.1, MP4) of 2 steps run as scripts (concurrently) and write files of the
requested shapes and a per-stage timing table; the option checks name the option, its value
and its range; bad checkpoints, shapes beyond Wan's rotary table and unwritable --out folders
exit 2 with a message (no traceback); a checkpoint saved without text encoders takes --prompt
through stand-in embeddings seeded by the text, as the server does."""

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
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
        for stage in ("text encoding", "denoising", "per step (mean of 2)", "vae decode",
                      "output encoding", "total"):  # the per-stage table
            line = rf"^ *{re.escape(stage)} .* \d+\.\d{{3}}"
            assert re.search(line, logs[name], re.M), logs[name]
    from PIL import Image

    with Image.open(runs["sd3"]) as image:
        assert image.format == "PNG" and image.size == (20, 12)  # (width, height)
    frames = imageio.mimread(runs["wan"])
    assert len(frames) == 9 and frames[0].shape == (48, 16, 3), (len(frames), frames[0].shape)


def test_vae_parallel_on_and_off_on_two_ranks(tmp_path):
    """Two gloo ranks (torchrun), Wan: the VAE decode banded over both ranks or the stock decode
    on each; the videos alike (the banded decode is exact up to float rounding)."""
    logs, videos = {}, {}
    for mode in ("on", "off"):
        videos[mode] = tmp_path / f"{mode}.mp4"
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", SCRIPT, "--device", "cpu", "--pipeline", "wan", "--steps", "1",
             "--vae-parallel", mode, "--out", str(videos[mode])],
            env=_env(), capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        logs[mode] = r.stdout
    assert "; VAE decode banded over 2 ranks" in logs["on"], logs["on"]
    assert "; VAE decode: stock on every rank" in logs["off"], logs["off"]
    for log in logs.values():
        assert re.search(r"^ *vae decode .* \d+\.\d{3}", log, re.M), log
    on, off = (np.stack(imageio.mimread(videos[m])).astype(np.float64) for m in ("on", "off"))
    assert on.shape == off.shape and np.abs(on - off).mean() < 1.0


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
    (["--vae-parallel", "yes"], "--vae-parallel: 'yes' is not one of on, off"),
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
    # a checkpoint: the published model's shape, steps and text length unless told otherwise
    args = _example().parse_args(["--device", "cpu", "--pipeline", "flux", "--weights", "x"])
    assert (args.size, args.height, args.width, args.steps, args.text_tokens) == (
        "full", 1024, 1024, 30, 512)


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
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "transformer" / "config.json"))
                       + ": cannot read a JSON config: .*No such file"):
        tiny.load_pipeline("flux", str(tmp_path))


def test_out_must_be_a_writable_place(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    (tmp_path / "dir.png").mkdir()
    cases = [(str(a_file / "x.png"), "(a file is in the way)"),
             ("/proc/x.png", "'/proc' is not a folder where files can be written"),
             (str(tmp_path / "dir.png"), "is a folder (give a file name in it)")]
    for out, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            _example().parse_args(["--device", "cpu", "--pipeline", "sd3", "--out", out])
    made = tmp_path / "new" / "folder"
    args = _example().parse_args(["--device", "cpu", "--pipeline", "sd3", "--out",
                                  str(made / "x.png")])
    assert made.is_dir() and os.listdir(made) == [] and args.out == str(made / "x.png")


def test_prompts_must_be_text():
    with pytest.raises(ValueError, match=r"--prompt: .* is not valid text \(surrogates not "
                       r"allowed at character 1\)"):
        _example().parse_args(["--device", "cpu", "--prompt", "a\ud800"])


@pytest.fixture(scope="module")
def no_encoders(tmp_path_factory):
    """A tiny Flux checkpoint saved without text encoders, and one whose config is hostile."""
    import json
    import shutil

    from ditscale.diffusers import tiny

    root = tmp_path_factory.mktemp("generate-weights")
    tiny.make_pipeline("flux", seed=3).save_pretrained(str(root / "flux"))
    shutil.copytree(root / "flux", root / "bad")
    config = root / "bad" / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": "2"}))
    return root


def test_a_checkpoint_without_text_encoders_takes_stand_in_embeddings(no_encoders, tmp_path,
                                                                      capsys):
    from PIL import Image

    from ditscale.diffusers import generation, tiny

    out = tmp_path / "fox.png"
    assert _example().main(["--device", "cpu", "--pipeline", "flux", "--weights",
                            str(no_encoders / "flux"), "--size", "tiny", "--text-tokens", "512",
                            "--prompt", "a fox", "--seed", "5", "--out", str(out)]) == 0
    assert "has no text encoders: --prompt gets stand-in embeddings of 512 tokens" in \
        capsys.readouterr().out
    pipe = tiny.load_pipeline("flux", str(no_encoders / "flux"))
    embeds = tiny.make_prompt_embeds(pipe, 512, negative=False,
                                     seed=generation.stand_in_seed("a fox", ""))
    height, width, _ = tiny.DEFAULT_SHAPES["flux"]["tiny"]
    kw = generation.call_kwargs("flux", height=height, width=width, frames=1, steps=2,
                                guidance=1.0, seeds=[5], device=torch.device("cpu"),
                                embeds=embeds)
    expected = generation.to_uint8(generation.output_array(pipe(**kw), False))[0]
    with Image.open(out) as image:
        assert (np.asarray(image) == expected).all()


def test_bad_runs_exit_2_with_a_message(no_encoders, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    bad_config = str(no_encoders / "bad" / "transformer" / "config.json")
    runs = {
        "weights": (["--pipeline", "flux", "--size", "tiny", "--weights",
                     str(no_encoders / "bad")],
                    f"{bad_config}: num_layers: expected an integer in [1, 256], got str '2'"),
        "rotary": (["--pipeline", "wan", "--height", "16384", "--frames", "1"],
                   "--height/--width/--frames: height 16384 is above 1024: out of range "
                   "[16, 1024] (the largest side covered by Wan's rotary table"),
        "out": (["--pipeline", "sd3", "--out", str(a_file / "x.png")],
                f"--out: {str(a_file)!r} is not a folder where files can be written"),
    }
    procs = {key: subprocess.Popen([sys.executable, SCRIPT, "--device", "cpu"] + argv,
                                   env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=str(tmp_path))
             for key, (argv, _) in runs.items()}
    try:
        logs = {key: proc.communicate(timeout=150) for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for key, (_, message) in runs.items():
        out, err = logs[key]
        assert procs[key].returncode == 2, (key, out, err)
        assert f"generate.py: error: {message}" in err and "Traceback" not in err, (key, err)
