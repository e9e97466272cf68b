"""ditscale.serve's parts without a server: request validation (body, schema), the job store
and its batching (jobs), event streams (waiting), the metrics, the options and their ranges
(options, cli), a batch's RunSpec and its calls (runner), the worker's failure paths (server),
the shape rules the limits come from (diffusers.generation)."""

import base64
import json
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale.diffusers import generation  # noqa: E402
from ditscale.serve import cli, jobs, metrics, options, runner, schema, waiting  # noqa: E402
from ditscale.serve.errors import RequestError  # noqa: E402
from ditscale.serve.app import route_label  # noqa: E402

IMAGE = schema.Limits(
    pipeline="sd3", video=False, pixel_multiple=16, frame_step=0, text_width=16,
    pooled_width=8, has_mask=False, has_encoders=False, default_size=(512, 768, 1),
    default_steps=4, default_guidance=7.0, max_size=1024, max_frames=1, max_steps=50,
    max_batch=4, max_n=4, max_timeout_s=60.0, stand_in_tokens=7)
VIDEO = schema.Limits(
    pipeline="hunyuan-video", video=True, pixel_multiple=16, frame_step=4, text_width=16,
    pooled_width=8, has_mask=True, has_encoders=False, default_size=(320, 512, 17),
    default_steps=4, default_guidance=1.0, max_size=1024, max_frames=33, max_steps=50,
    max_batch=2, max_n=2, max_timeout_s=60.0, stand_in_tokens=7)


def refused(body, lim=IMAGE, kind=None):
    with pytest.raises(RequestError) as info:
        schema.parse_request(body, kind or ("video" if lim.video else "image"), lim)
    return info.value


# ---- schema -------------------------------------------------------------------------------

def test_defaults_and_sizes():
    r = schema.parse_request({"prompt": "x", "seed": 3}, "image", IMAGE)
    assert (r.height, r.width, r.frames, r.steps, r.guidance, r.n) == (512, 768, 1, 4, 7.0, 1)
    assert r.text_source == "stand-in" and r.seed == 3 and r.response_format == "b64_json"
    assert r.timeout_s == 60.0 and not r.async_
    r = schema.parse_request({"prompt": "x", "size": "1024x256"}, "image", IMAGE)
    assert (r.width, r.height) == (1024, 256)
    r = schema.parse_request({"prompt": "x", "width": 32, "height": 1008}, "image", IMAGE)
    assert (r.width, r.height) == (32, 1008)
    a = schema.parse_request({"prompt": "x"}, "image", IMAGE)
    b = schema.parse_request({"prompt": "x"}, "image", IMAGE)
    assert a.seed != b.seed and 0 <= a.seed < 2**62  # drawn by the server


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "size": "1000x512"}, "size", "width 1000 is not a multiple of 16"),
    ({"prompt": "x", "size": "512x2048"}, "size", "height 2048 is out of range [16, 1024]"),
    ({"prompt": "x", "size": "0x0"}, "size", "out of range [16, 1024]"),
    ({"prompt": "x", "size": "5１2x512"}, "size", "is not \"<width>x<height>\""),
    ({"prompt": "x", "size": 512}, "size", "expected a string, got int"),
    ({"prompt": "x", "size": "512x512", "width": 512}, "size", "not both"),
    ({"prompt": "x", "width": 8}, "width", "8 is out of range [16, 1024]"),
    ({"prompt": "x", "height": "512"}, "height", "expected an integer, got str"),
    ({"prompt": "x", "steps": 51}, "steps", "51 is out of range [1, 50]"),
    ({"prompt": "x", "steps": True}, "steps", "expected an integer, got bool"),
    ({"prompt": "x", "n": 0}, "n", "0 is out of range [1, 4]"),
    ({"prompt": "x", "n": 2, "seed": 2**63 - 1}, "seed", "out of range [0, 9223372036854775806]"),
    ({"prompt": "x", "guidance": 101}, "guidance", "101 is out of range [0, 100]"),
    ({"prompt": "x", "timeout": 61}, "timeout", "61 is out of range (0, 60]"),
    ({"prompt": "x", "async": 1}, "async", "expected true or false"),
    ({"prompt": "x" * 10001}, "prompt", "10001 characters, at most 10000"),
    ({"prompt": "x", "user": "u" * 257}, "user", "at most 256"),
    ({"prompt": "x", "output_format": "mp4"}, "output_format", "'mp4' is not one of 'png'"),
    ({"prompt": "x", "fps": 8}, "fps", "unknown field"),
    ({"prompt": "x", "guidance": 1.0, "negative_prompt": "y"}, "negative_prompt",
     "without guidance"),
    ({"prompt": "x", "prompt_attention_mask": [[1]]}, "prompt_attention_mask",
     "unknown field"),
])
def test_bad_fields_are_named(body, param, words):
    err = refused(body)
    assert err.status == 400 and err.param == param, err.message
    assert err.message.startswith(param + ":") and words in err.message, err.message


def test_video_fields_and_frames():
    r = schema.parse_request({"prompt": "x", "frames": 33, "fps": 24, "output_format": "gif"},
                             "video", VIDEO)
    assert (r.frames, r.fps, r.output_format, r.kind) == (33, 24, "gif", "video")
    assert schema.parse_request({"prompt": "x"}, "video", VIDEO).frames == 17
    err = refused({"prompt": "x", "frames": 6}, VIDEO)
    assert err.param == "frames" and "6 is not 1 + a multiple of 4" in err.message
    assert refused({"prompt": "x", "frames": 37}, VIDEO).param == "frames"
    assert refused({"prompt": "x", "fps": 0}, VIDEO).param == "fps"
    err = refused({"prompt": "x"}, VIDEO, kind="image")
    assert err.code == "wrong_endpoint" and "POST /v1/videos/generations" in err.message
    assert refused({"prompt": "x"}, IMAGE, kind="video").code == "wrong_endpoint"


def _b64(array, dtype="float32"):
    if dtype == "bfloat16":
        raw = torch.tensor(array, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    else:
        raw = np.asarray(array, dtype=dtype).astype("<" + np.dtype(dtype).str[1:]).tobytes()
    return {"shape": list(np.shape(array)), "dtype": dtype, "b64": base64.b64encode(raw).decode()}


def test_prompt_embeddings_as_lists_and_base64():
    rng = np.random.default_rng(0)
    e = rng.standard_normal((1, 5, 16)).astype(np.float32)
    p = rng.standard_normal((1, 8)).astype(np.float32)
    for encode in (lambda a: a.tolist(), _b64, lambda a: _b64(a, "float16"),
                   lambda a: _b64(a, "bfloat16")):
        r = schema.parse_request({"prompt_embeds": encode(e), "pooled_prompt_embeds": encode(p),
                                  "guidance": 1.0}, "image", IMAGE)
        assert r.text_source == "request" and set(r.embeds) == {"prompt_embeds",
                                                                 "pooled_prompt_embeds"}
        assert r.embeds["prompt_embeds"].dtype == torch.float32
        assert torch.allclose(r.embeds["prompt_embeds"], torch.from_numpy(e), atol=0.02)
    # Hunyuan: the mask defaults to all ones; guidance needs the negative's, of the same length
    r = schema.parse_request({"prompt_embeds": e.tolist(), "pooled_prompt_embeds": p.tolist()},
                             "video", VIDEO)
    assert r.embeds["prompt_attention_mask"].tolist() == [[1] * 5]
    assert r.batch_key() != schema.parse_request(
        {"prompt_embeds": e[:, :4].tolist(), "pooled_prompt_embeds": p.tolist()}, "video",
        VIDEO).batch_key()


@pytest.mark.parametrize("extra, param, words", [
    ({"prompt_embeds": [[[0.0] * 16] * 2], "pooled_prompt_embeds": [[0.0] * 8],
      "prompt_attention_mask": [[0, 0]]}, "prompt_attention_mask", "no valid text token"),
    ({"prompt_embeds": [[[0.0] * 16] * 2], "pooled_prompt_embeds": [[0.0] * 8],
      "prompt_attention_mask": [[1, 2]]}, "prompt_attention_mask", "of 0 and 1"),
    ({"prompt_embeds": [[[0.0] * 16] * 2], "pooled_prompt_embeds": [[0.0] * 8],
      "guidance": 5.0, "negative_prompt_embeds": [[[0.0] * 16] * 3],
      "negative_pooled_prompt_embeds": [[0.0] * 8]}, "negative_prompt_embeds",
     "3 tokens; prompt_embeds has 2"),
    ({"prompt_embeds": [[[0.0] * 16] * 2], "pooled_prompt_embeds": [[0.0] * 8],
      "negative_prompt_embeds": [[[0.0] * 16] * 2]}, "negative_prompt_embeds",
     "without guidance"),
    ({"prompt_embeds": [[[0.0] * 16, [1.0]]], "pooled_prompt_embeds": [[0.0] * 8]},
     "prompt_embeds", "not a rectangular nested list"),
    ({"prompt_embeds": [[["1"] * 16]], "pooled_prompt_embeds": [[0.0] * 8]},
     "prompt_embeds", "not a rectangular nested list of numbers"),
    ({"prompt_embeds": [[[True] * 16]], "pooled_prompt_embeds": [[0.0] * 8]},
     "prompt_embeds", "not a rectangular nested list of numbers"),
    ({"prompt_embeds": [[[1e39] * 16]], "pooled_prompt_embeds": [[0.0] * 8]},
     "prompt_embeds", "NaN or infinite"),
    ({"prompt_embeds": {"shape": [1, 2, 16], "dtype": "int8", "b64": ""},
      "pooled_prompt_embeds": [[0.0] * 8]}, "prompt_embeds.dtype", "'int8' is not one of"),
    ({"prompt_embeds": {"shape": [1, 0, 16], "b64": ""}, "pooled_prompt_embeds": [[0.0] * 8]},
     "prompt_embeds.shape", "is not a list of 1-4 integers"),
    ({"prompt_embeds": {"shape": [1, 4097, 16], "b64": ""},
      "pooled_prompt_embeds": [[0.0] * 8]}, "prompt_embeds.shape", "at most 65536"),
    ({"prompt_embeds": {"shape": [1, 2, 16], "b64": "!!"}, "pooled_prompt_embeds": [[0.0] * 8]},
     "prompt_embeds.b64", "not base64"),
    ({"prompt_embeds": {"shape": [1, 2, 16], "b64": "", "order": "C"},
      "pooled_prompt_embeds": [[0.0] * 8]}, "prompt_embeds.order", "unknown field"),
    ({"prompt_embeds": [[[0.0] * 16]], "pooled_prompt_embeds": [[0.0] * 7]},
     "pooled_prompt_embeds", "expected [1, 8]"),
])
def test_bad_embeddings_are_named(extra, param, words):
    err = refused(extra, VIDEO)
    assert err.param == param and words in err.message, err.message


def test_error_body_is_the_openai_shape():
    assert RequestError(429, "full", code="queue_full").body() == {"error": {
        "message": "full", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    assert RequestError(503, "x").body()["error"]["type"] == "server_error"
    err = schema.bad("steps", "too many")
    assert json.loads(err.json_bytes())["error"] == {
        "message": "steps: too many", "type": "invalid_request_error", "param": "steps",
        "code": "invalid_value"}


# ---- jobs ---------------------------------------------------------------------------------

def req(**kw):
    return schema.parse_request({"prompt": "x", "seed": 1, **kw}, "image", IMAGE)


def test_queue_bound_and_batches_of_compatible_requests():
    store = jobs.JobStore(max_queue=5, max_batch=4)
    a = store.submit(req())
    b = store.submit(req(size="256x256"))
    c = store.submit(req(n=2))
    d = store.submit(req(n=2))
    e = store.submit(req())
    with pytest.raises(RequestError) as info:
        store.submit(req())
    assert info.value.status == 429 and info.value.code == "queue_full"
    batch = store.next_batch(0)
    assert batch == [a, c, e] and all(j.status == "running" for j in batch)  # 1 + 2 + 1 = 4
    assert store.depth() == 2 and store.running == batch
    assert store.submit(req()).status == "queued"  # the running batch does not count
    assert store.next_batch(0) == [b]
    assert store.next_batch(0)[0] is d
    for j in batch:
        store.complete(j, {"ok": 1})
    assert a.status == "succeeded" and a.step == a.request.steps and a.version > 2


def test_cancel_expire_and_forget():
    store = jobs.JobStore(max_queue=10, max_batch=1, keep=2)
    finished = []
    store.on_finish = finished.append
    queued = store.submit(req())
    running = store.submit(req())
    late = store.submit(req(timeout=0.05))
    store.cancel(queued.id)
    assert queued.status == "cancelled" and queued.error.status == 409
    assert store.next_batch(0) == [running]
    store.cancel(running.id)
    assert running.status == "running" and running.cancel_requested
    time.sleep(0.06)
    assert store.get(late.id).status == "failed" and late.error.status == 504
    assert late.error.param == "timeout" and store.depth() == 0
    store.fail(running, RequestError(409, "cancelled", code="cancelled"))
    assert running.status == "cancelled" and finished == [queued, late, running]
    with pytest.raises(RequestError) as info:  # keep=2: the oldest finished is forgotten
        store.get(queued.id)
    assert info.value.status == 404 and info.value.param == "id"
    store.complete(running, {"late": True})  # a finished job stays as it ended
    assert running.status == "cancelled" and running.result is None


def test_wait_wakes_on_change_and_closing_refuses():
    store = jobs.JobStore(max_queue=10, max_batch=1)
    job = store.submit(req())
    v = job.version
    threading.Timer(0.05, lambda: store.progress(job, 1)).start()
    begin = time.monotonic()
    assert store.wait(job, v, timeout=5) != v and time.monotonic() - begin < 2
    assert store.close("shutting down") == [job]
    with pytest.raises(RequestError) as info:
        store.submit(req())
    assert info.value.status == 503 and info.value.code == "shutting_down"
    view = job.view()
    assert view["progress"] == {"step": 1, "steps": 4} and view["text_encoder"] == "stand-in"


# ---- metrics ------------------------------------------------------------------------------

def test_prometheus_text():
    m = metrics.Metrics()
    m.requests.labels(endpoint="POST /v1/images/generations", status="200").inc(2)
    m.gpu_memory_bytes.labels(rank="0", kind="peak").set(1024)
    for v in (0.05, 0.3, 1000.0):
        m.job_latency_seconds.observe(v)
    m.stage_seconds.labels(stage="vae_decode").observe(0.02)
    lines = m.render().decode().splitlines()
    assert ('ditscale_serve_requests_total{endpoint="POST /v1/images/generations",'
            'status="200"} 2.0') in lines
    assert 'ditscale_serve_gpu_memory_bytes{kind="peak",rank="0"} 1024.0' in lines
    assert 'ditscale_serve_job_latency_seconds_bucket{le="0.05"} 1.0' in lines  # le: <=
    assert 'ditscale_serve_job_latency_seconds_bucket{le="0.5"} 2.0' in lines
    assert 'ditscale_serve_job_latency_seconds_bucket{le="+Inf"} 3.0' in lines
    assert "ditscale_serve_job_latency_seconds_count 3.0" in lines
    assert 'ditscale_serve_stage_seconds_bucket{le="0.025",stage="vae_decode"} 1.0' in lines
    assert "ditscale_serve_queue_depth 0.0" in lines  # an unset gauge reads 0
    assert "# TYPE ditscale_serve_run_seconds histogram" in lines
    for name, (kind, _, _, _) in metrics.SPECS.items():
        full = name + ("_total" if kind._type == "counter" else "")
        assert f"# TYPE ditscale_serve_{full} {kind._type}" in lines
    assert metrics.Metrics().render() != m.render()  # one registry a server


def test_route_labels_are_bounded():
    assert route_label("/v1/jobs/gen-0123456789abcdef/events") == "/v1/jobs/{id}/events"
    assert route_label("/v1/files/gen-0123456789abcdef-3.mp4") == "/v1/files/{name}"


# ---- options ------------------------------------------------------------------------------

def test_option_defaults():
    o = options.parse(["--pipeline", "wan"])
    assert (o.size, o.device, o.dtype, o.host, o.port, o.steps) == (
        "tiny", "cpu", "float32", "127.0.0.1", 8000, 2)
    assert o.max_size is None and o.max_frames == 33 and o.text_tokens == 7
    assert o.shutdown_grace_s < 30  # below torchrun's SIGKILL after a forwarded signal
    o = options.parse(["--pipeline", "flux", "--full-size", "--max-steps", "10"], True)
    assert (o.size, o.device, o.dtype, o.steps, o.text_tokens) == ("full", "cuda", "bfloat16",
                                                                  10, 512)


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "--port: 70000 is out of range [0, 65535]"),
    (["--max-queue", "0"], "--max-queue: 0 is out of range [1, 100000]"),
    (["--max-batch", "65"], "--max-batch: 65 is out of range [1, 64]"),
    (["--max-size", "4"], "--max-size: 4 is out of range [8, 16384]"),
    (["--max-frames", "0"], "--max-frames: 0 is out of range [1, 1025]"),
    (["--max-steps", "1001"], "--max-steps: 1001 is out of range [1, 1000]"),
    (["--steps", "11", "--max-steps", "10"], "--steps: 11 is out of range [1, 10]"),
    (["--request-timeout", "0"], "--request-timeout: 0 is out of range (0, 86400]"),
    (["--request-timeout", "nan"], "--request-timeout: nan is out of range"),
    (["--max-body-mib", "0"], "--max-body-mib: 0 is out of range [1, 4096]"),
    (["--max-connections", "0"], "--max-connections: 0 is out of range [1, 100000]"),
    (["--heartbeat", "0.01"], "--heartbeat: 0.01 is out of range [0.05, 60]"),
    (["--group-timeout", "4"], "--group-timeout: 4 is out of range [5, 3600]"),
    (["--group-timeout", "6", "--heartbeat", "2"], "at least 5x --heartbeat"),
    (["--shutdown-grace", "-1"], "--shutdown-grace: -1 is out of range [0, 3600]"),
    (["--keep-files", "0"], "--keep-files: 0 is out of range [1, 1000000]"),
    (["--keep-jobs", "0"], "--keep-jobs: 0 is out of range [1, 1000000]"),
    (["--png-level", "10"], "--png-level: 10 is out of range [0, 9]"),
    (["--text-tokens", "0"], "--text-tokens: 0 is out of range [1, 4096]"),
    (["--warmup", "101"], "--warmup: 101 is out of range [0, 100]"),
    (["--seed", "-1"], "--seed: -1 is out of range"),
    (["--weights", "/x", "--size", "small"], "--weights: give a checkpoint folder or --size"),
    (["--full-size", "--size", "small"], "--full-size: given with --size small"),
    (["--cache", "first-block:2"], "--cache first-block:threshold: 2"),
    (["--cache", "teacache:0.1"], "--cache: 'teacache:0.1' is not none or one of"),
])
def test_bad_options_are_named(argv, words, capsys):
    with pytest.raises(ValueError) as info:
        options.parse(["--pipeline", "sd3"] + argv)
    assert words in str(info.value)
    assert cli.main(["--pipeline", "sd3"] + argv) == 2  # the command: exit status 2
    assert words in capsys.readouterr().err


def test_unknown_choices_exit_2(capsys):
    for argv in (["--pipeline", "sdxl"], ["--pipeline", "sd3", "--strategy", "fast"]):
        with pytest.raises(SystemExit) as info:
            options.parse(argv)
        assert info.value.code == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_max_frames_follow_wans_rotary_table():
    from ditscale.diffusers import tiny

    wan = tiny.make_pipeline("wan")
    assert cli.limits_of(wan, options.parse(["--pipeline", "wan", "--max-frames", "253"])
                         ).max_frames == 253
    with pytest.raises(ValueError, match="--max-frames: 1025 is above 253, the most frames"):
        cli.limits_of(wan, options.parse(["--pipeline", "wan", "--max-frames", "1025"]))


def test_limits_follow_the_model():
    from ditscale.diffusers import tiny

    sd3 = tiny.make_pipeline("sd3")
    lim = cli.limits_of(sd3, options.parse(["--pipeline", "sd3"]))
    assert (lim.pixel_multiple, lim.max_size, lim.text_width, lim.pooled_width) == (4, 64, 16, 8)
    assert lim.default_size == (12, 20, 1) and not lim.video and not lim.has_encoders
    with pytest.raises(ValueError, match="--max-size: 128 is above 64"):
        cli.limits_of(sd3, options.parse(["--pipeline", "sd3", "--max-size", "128"]))
    # a default the user never gave is fitted within the sizes allowed, never a refusal
    lim = cli.limits_of(sd3, options.parse(["--pipeline", "sd3", "--max-size", "16"]))
    assert lim.default_size == (8, 16, 1)
    # a small checkpoint: the full size's default (1024 px) fitted within its 64 px
    lim = cli.limits_of(sd3, options.parse(["--pipeline", "sd3", "--weights", "/ckpt"]))
    assert lim.max_size == 64 and max(lim.default_size[:2]) <= 64
    cog = tiny.make_pipeline("cogvideox")
    lim = cli.limits_of(cog, options.parse(["--pipeline", "cogvideox"]))
    assert (lim.frame_step, lim.max_frames, lim.default_size) == (8, 33, (24, 8, 9))
    lim = cli.limits_of(cog, options.parse(["--pipeline", "cogvideox", "--max-frames", "5"]))
    assert lim.default_size == (24, 8, 1)


def test_shape_rules():
    from ditscale.diffusers import generation, tiny

    sd3 = generation.shape_rule("sd3", tiny.make_pipeline("sd3"))
    assert (sd3.pixel_multiple, sd3.frame_step, sd3.max_side) == (4, 0, 64)
    assert "height 68 is above 64" in generation.shape_error(sd3, 68, 64, 1)
    cog = generation.shape_rule("cogvideox", tiny.make_pipeline("cogvideox"))
    assert cog.frame_step == 8  # an even latent frame count comes back with extra frames
    assert "frames 13 is not 1 + a multiple of 8" in generation.shape_error(cog, 24, 8, 13)
    assert generation.shape_error(cog, 24, 8, 17) is None


# ---- runner -------------------------------------------------------------------------------

def test_run_spec_of_a_batch():
    a, b = req(seed=10, n=2), req(seed=20)
    spec = runner.build_spec([a, b], 7)
    assert spec.seeds == [10, 11, 20] and spec.requests == 2 and not spec.embeds
    assert spec.stand_in == [generation.stand_in_seed("x", "")] * 3 and spec.stand_in_tokens == 7
    e = [[[float(i)] * 16] * 3 for i in range(2)]
    c = schema.parse_request({"prompt_embeds": [e[0]], "pooled_prompt_embeds": [[0.0] * 8],
                              "guidance": 1.0, "n": 2}, "image", IMAGE)
    d = schema.parse_request({"prompt_embeds": [e[1]], "pooled_prompt_embeds": [[1.0] * 8],
                              "guidance": 1.0}, "image", IMAGE)
    spec = runner.build_spec([c, d], 7)
    assert spec.embeds["prompt_embeds"].shape == (3, 3, 16) and not spec.stand_in
    assert spec.embeds["prompt_embeds"][:, 0, 0].tolist() == [0.0, 0.0, 1.0]
    assert spec.embeds["pooled_prompt_embeds"][:, 0].tolist() == [0.0, 0.0, 1.0]
    # a batch above the call limit: calls of at most 2 samples, seeds and rows in order
    parts = runner.split_spec(spec, 2)
    assert [p.seeds for p in parts] == [spec.seeds[:2], spec.seeds[2:]]
    assert [p.embeds["prompt_embeds"][:, 0, 0].tolist() for p in parts] == [[0.0, 0.0], [1.0]]
    text = runner.split_spec(runner.build_spec([req(seed=1, n=3)], 7), 1)
    assert [(p.seeds, len(p.stand_in)) for p in text] == [([1], 1), ([2], 1), ([3], 1)]
    assert runner.split_spec(spec, 3) == [spec]


def test_nested_embeddings_are_bounded_before_conversion(monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted before the size check")

    monkeypatch.setattr(schema.np, "asarray", no_conversion)
    row = [0.0] * 16
    err = refused({"prompt_embeds": [[row] * 5000], "pooled_prompt_embeds": [[0.0] * 8],
                   "guidance": 1.0})
    assert err.param == "prompt_embeds" and "at most 65536" in err.message, err.message
    err = refused({"prompt_embeds": [[[[[[0.0]]]]]], "pooled_prompt_embeds": [[0.0] * 8],
                   "guidance": 1.0})
    assert "1-4 dimensions" in err.message, err.message


def test_a_finished_jobs_event_stream_ends_on_its_status():
    """The last event names the final status, even when the job finishes between two reads
    (the name and the data come from one snapshot)."""
    import asyncio

    async def stream(store, job):
        return [chunk async for chunk in waiting.events(store, job)]

    for _ in range(20):
        store = jobs.JobStore(max_queue=2, max_batch=1)
        job = store.submit(req(steps=4))
        store.next_batch(0)
        finisher = threading.Thread(target=lambda: [store.progress(job, i) for i in
                                                    range(1, 5)] + [store.complete(job, {})])
        finisher.start()
        chunks = asyncio.run(asyncio.wait_for(stream(store, job), 10))
        finisher.join()
        names = [c.split("\n")[0] for c in chunks]
        assert names[-1] == "event: succeeded" and names.count("event: succeeded") == 1, names
        assert all(n == "event: progress" for n in names[:-1]), names
        assert json.loads(chunks[-1].split("data: ")[1])["progress"]["step"] == 4


def test_wait_done_wakes_once_finished_and_expires_queued_jobs():
    store = jobs.JobStore(max_queue=10, max_batch=1)
    job = store.submit(req())
    late = store.submit(req(timeout=0.05))
    threading.Timer(0.05, lambda: store.fail(job, RequestError(409, "x", code="cancelled"))).start()
    begin = time.monotonic()
    assert store.wait_done(job, timeout=5) and time.monotonic() - begin < 2
    assert store.wait_done(late, timeout=5) and late.error.code == "timeout"
    assert not store.wait_done(store.submit(req()), timeout=0.01)


def test_a_batch_the_worker_cannot_prepare_fails_alone(monkeypatch, tmp_path):
    """A request that breaks the worker's preparation (a lone surrogate reaching it once shut
    the group down with exit 2 and lost the queue) fails alone; the next job runs."""
    import types

    from ditscale.serve import server as server_mod
    from ditscale.serve.group import ControlGroup

    pipe = types.SimpleNamespace(transformer=types.SimpleNamespace(device=torch.device("cpu")))
    opts = options.parse(["--pipeline", "sd3", "--output-dir", str(tmp_path)])
    core = server_mod.Server(pipe, opts, IMAGE, ControlGroup(10.0))
    bad, good = core.store.submit(req(seed=1)), core.store.submit(req(seed=2, size="32x32"))

    def broken(requests, tokens):
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(server_mod, "build_spec", broken)
    core._run_batch(core.store.next_batch(0))
    assert bad.status == "failed" and bad.error.status == 500, bad
    assert bad.error.code == "internal_error" and "UnicodeEncodeError" in bad.error.message
    assert good.status == "queued" and core.store.closed is None and not core.store.running
    assert core.store.next_batch(0) == [good]
    core.encoder.shutdown()


def test_a_failed_collective_of_the_pipeline_breaks_the_group():
    assert runner._data_plane_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] "
                                                   "Timed out waiting 10000ms"))
    assert runner._data_plane_failure(torch.distributed.DistBackendError("NCCL error"))
    assert not runner._data_plane_failure(ValueError("a shape"))
    assert not runner._data_plane_failure(RuntimeError("mat1 and mat2 shapes cannot be "
                                                       "multiplied"))


def test_output_dir_must_take_files(tmp_path, capsys):
    """A file in the way (generation.check_output_dir): exit 2 at startup, before any
    request (not a failure of every url request)."""
    (tmp_path / "file").write_text("x")
    code = cli.main(["--pipeline", "sd3", "--device", "cpu", "--port", "0",
                     "--output-dir", str(tmp_path / "file")])
    err = capsys.readouterr().err
    assert code == 2 and "--output-dir:" in err and "a file is in the way" in err, err


def test_a_clients_value_is_quoted_short():
    for body, param in (({"prompt": "x", "model": "m" * 100000}, "model"),
                        ({"prompt": "x", "size": "9" * 100000}, "size"),
                        ({"prompt": "x", "steps": 10**4000}, "steps"),
                        ({"prompt": "x", "response_format": "j" * 100000}, "response_format")):
        err = refused(body)
        assert err.param == param and len(err.message) < 400, err.message[:500]
