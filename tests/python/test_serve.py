"""python -m ditscale.serve end to end on the CPU: real HTTP on loopback, real ranks (torchrun,
2 processes over gloo), tiny random-weight pipelines of 1-2 steps.

One 2-rank SD3 server (the module's fixture) answers most tests, in file order; the last one
shuts it down gracefully. A 2-rank Wan server serves a video, then a rank stops (SIGSTOP)
mid-request: every rank's wait ends within one group timeout.
The pipeline's direct output comes from the same pipeline built the same way and run directly
on 2 gloo ranks (gloo_util), and must be bit-identical to the server's. The benchmark
(bench/serve/bench_serve.py) runs once with minimal counts. Every subprocess has a timeout
and is killed in a finally.
"""

import base64
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
imageio = pytest.importorskip("imageio")

import ditscale  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_S = 180.0  # a server's start on a loaded 2-core machine
PROMPT_TOKENS = 7  # the tiny pipelines' stand-in text length (tiny.TEXT_TOKENS)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    package_dir = os.path.dirname(os.path.dirname(ditscale.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_dir, ROOT, env.get("PYTHONPATH"))
                                        if p)
    return env


# ---- a server process ---------------------------------------------------------------------

class Served:
    """``python -m ditscale.serve`` (under torchrun with ``nproc`` > 1) started in its own
    process group, its log in ``log_path``; ``url`` once it listens."""

    def __init__(self, args, nproc: int, log_path):
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                   "-m", "ditscale.serve"]
        else:
            cmd = [sys.executable, "-m", "ditscale.serve"]
        self.log_path = str(log_path)
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd + ["--device", "cpu", "--port", "0"] + list(args),
                                     env=_env(), stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url, self.ranks = None, []
        deadline = time.monotonic() + STARTUP_S
        while self.url is None:
            for line in self.log().splitlines():
                if "ditscale.serve: listening on http://" in line:
                    self.url = line.split("listening on ")[1].split()[0]
            if self.url is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    pytest.fail(f"the server did not start:\n{self.log()[-4000:]}")
                time.sleep(0.1)
        self.ranks = [r["pid"] for r in call(self.url, "GET", "/health")[1]["ranks"]]

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server did not exit within {timeout:g} s:\n{self.log()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL to the launcher and to each rank (torchrun starts every rank in a session
        of its own: the launcher's death would leave them running)."""
        pids = set(self.ranks) | set(_children(self.proc.pid))
        if self.proc.poll() is None:
            pids.add(self.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self.log_file.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int):
    """The pids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def request(url, method, path, body=None, timeout=60.0, headers=None):
    """(status, headers, body bytes) of one HTTP request; ``body`` a dict is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url + path, data, hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def call(url, method, path, body=None, timeout=60.0):
    status, _, raw = request(url, method, path, body, timeout)
    return status, json.loads(raw)


def png_array(b64: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)


def job(url, job_id) -> dict:
    return call(url, "GET", f"/v1/jobs/{job_id}")[1]


def running_step(url) -> int:
    """The denoising steps done by the running job (-1: none runs)."""
    running = call(url, "GET", "/health")[1]["running"]
    return job(url, running[0])["progress"]["step"] if running else -1


def metric(url, name: str) -> float:
    """The sum of every series of ``ditscale_serve_<name>`` in /metrics."""
    _, _, raw = request(url, "GET", "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(f"ditscale_serve_{name}{{") or line.startswith(
                f"ditscale_serve_{name} "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- the direct pipeline run on 2 gloo ranks ----------------------------------------------

def direct_outputs(rank, world, cases):
    """Each case's uint8 output of the pipeline built and parallelized as the server does it,
    called directly with the request's arguments."""
    from ditscale.diffusers import generation, parallelize_pipeline, tiny
    from ditscale.diffusers.generation import stand_in_seed

    out, pipes = [], {}
    for name, height, width, frames, steps, guidance, seed, text in cases:
        if name not in pipes:
            pipes[name] = parallelize_pipeline(tiny.make_pipeline(name, seed=0),
                                               cfg_parallel=True, strategy="auto")
        pipe = pipes[name]
        if isinstance(text, str):  # the stand-in embeddings of a prompt
            embeds = tiny.make_prompt_embeds(pipe, PROMPT_TOKENS, negative=guidance > 1,
                                             seed=stand_in_seed(text, ""))
        else:
            embeds = {k: torch.tensor(v, dtype=torch.float32) for k, v in text.items()}
        kw = generation.call_kwargs(name, height=height, width=width, frames=frames,
                                    steps=steps, guidance=guidance, seeds=[seed],
                                    device=torch.device("cpu"), embeds=embeds)
        with torch.no_grad():
            array = generation.output_array(pipe(**kw), name in tiny.VIDEO_PIPELINES)
        out.append(generation.to_uint8(array)[0])
    return out


def run_direct(cases):
    gloo_util = pytest.importorskip("gloo_util")
    results = gloo_util.run_gloo(direct_outputs, 2, cases, timeout_s=240)
    assert all(np.array_equal(a, b) for a, b in zip(*results)), "the 2 ranks differ"
    return results[0]


# ---- the 2-rank SD3 server ----------------------------------------------------------------

SD3_ARGS = ["--pipeline", "sd3", "--max-queue", "4", "--max-batch", "4", "--heartbeat", "0.5",
            "--group-timeout", "60", "--max-body-mib", "1", "--request-timeout", "120"]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-sd3")
    server = Served(SD3_ARGS + ["--output-dir", str(folder / "files")], 2,
                    folder / "server.log")
    server.files = folder / "files"
    try:
        yield server
    finally:
        server.kill()


def embeds_body(rng, tokens=5, negative=True):
    """Prompt embeddings for the tiny SD3 (text width 16, pooled 8) as nested lists."""
    body = {"prompt_embeds": rng.standard_normal((1, tokens, 16)).round(3).tolist(),
            "pooled_prompt_embeds": rng.standard_normal((1, 8)).round(3).tolist()}
    if negative:
        body["negative_prompt_embeds"] = rng.standard_normal((1, tokens, 16)).round(3).tolist()
        body["negative_pooled_prompt_embeds"] = rng.standard_normal((1, 8)).round(3).tolist()
    return body


def test_health_models_and_metrics(sd3):
    status, health = call(sd3.url, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["world_size"] == 2
    assert [r["rank"] for r in health["ranks"]] == [0, 1]
    status, models = call(sd3.url, "GET", "/v1/models")
    model = models["data"][0]
    assert status == 200 and model["id"] == "sd3" and model["kind"] == "image"
    # the tiny SD3: a 2x VAE and patch 2 (multiple 4), a 16-patch position embedding (64 px)
    assert model["limits"]["pixel_multiple"] == 4 and model["limits"]["max_size"] == 64
    assert model["defaults"] == {"size": "20x12", "frames": 1, "steps": 2, "guidance": 7.0}
    status, _, raw = request(sd3.url, "GET", "/metrics")
    text = raw.decode()
    for name in ("requests_total", "jobs_total", "queue_depth", "running_jobs",
                 "job_latency_seconds_bucket", "run_seconds_count", "steps_total",
                 "steps_per_second", "samples_total"):
        assert f"ditscale_serve_{name}" in text, name


def test_images_equal_the_pipeline_run_directly(sd3):
    rng = np.random.default_rng(0)
    embeds = embeds_body(rng)
    requests = [  # (request body, the direct call's case)
        ({"prompt": "a red fox", "seed": 11, "steps": 2},
         ("sd3", 12, 20, 1, 2, 7.0, 11, "a red fox")),
        ({**embeds, "size": "16x8", "seed": 5, "steps": 1, "guidance": 3.0},
         ("sd3", 8, 16, 1, 1, 3.0, 5, embeds)),
        ({"prompt": "a red fox", "seed": 12, "steps": 2, "guidance": 1.0},
         ("sd3", 12, 20, 1, 2, 1.0, 12, "a red fox")),
    ]
    got = []
    for body, _ in requests:
        status, result = call(sd3.url, "POST", "/v1/images/generations", body)
        assert status == 200, result
        assert result["text_encoder"] == ("request" if "prompt_embeds" in body else "stand-in")
        assert result["seed"] == body["seed"] and result["batch"]["requests"] == 1
        got.append(png_array(result["data"][0]["b64_json"]))
    assert got[0].shape == (12, 20, 3) and got[1].shape == (8, 16, 3)
    expected = run_direct([case for _, case in requests])
    for (body, _), image, ref in zip(requests, got, expected):
        assert np.array_equal(image, ref), (body.get("seed"), np.abs(
            image.astype(int) - ref).max())
    assert not np.array_equal(got[0], got[2])  # the seed and guidance matter


def test_url_response_writes_a_whole_file(sd3):
    body = {"prompt": "a red fox", "seed": 11, "steps": 2}
    status, inline = call(sd3.url, "POST", "/v1/images/generations", body)
    status, result = call(sd3.url, "POST", "/v1/images/generations",
                          {**body, "response_format": "url"})
    assert status == 200, result
    url = result["data"][0]["url"]
    assert url.startswith(sd3.url + "/v1/files/gen-") and url.endswith("-0.png")
    status, headers, raw = request(sd3.url, "GET", url[len(sd3.url):])
    assert status == 200 and headers["Content-Type"] == "image/png"
    assert raw == base64.b64decode(inline["data"][0]["b64_json"])
    assert os.listdir(sd3.files) == [url.rsplit("/", 1)[1]]
    status, err = call(sd3.url, "GET", "/v1/files/gen-0000000000000000-0.png")
    assert status == 404 and err["error"]["code"] == "not_found"


def _bad_cases():
    big = {"prompt_embeds": [[[0.0] * 16] * 5]}
    return [  # (body, status, param, words of the message)
        ({"prompt": "x", "size": "21x12"}, 400, "size", "width 21 is not a multiple of 4"),
        ({"prompt": "x", "width": 20, "height": 14}, 400, "height", "not a multiple of 4"),
        ({"prompt": "x", "size": "128x128"}, 400, "size", "out of range [4, 64]"),
        ({"prompt": "x", "size": "big"}, 400, "size", "is not \"<width>x<height>\""),
        ({"prompt": "x", "steps": 0}, 400, "steps", "steps: 0 is out of range [1, 100]"),
        ({"prompt": "x", "steps": 101}, 400, "steps", "101 is out of range [1, 100]"),
        ({"prompt": "x", "steps": 2.0}, 400, "steps", "expected an integer"),
        ({"prompt": "x", "num_inference_steps": 2}, 400, "num_inference_steps",
         "unknown field"),
        ({"prompt": "x", "guidance": -1}, 400, "guidance", "out of range [0, 100]"),
        ({"prompt": "x", "n": 9}, 400, "n", "9 is out of range [1, 8]"),
        ({"prompt": "x", "seed": -1}, 400, "seed", "out of range"),
        ({"prompt": "x", "timeout": 0}, 400, "timeout", "out of range (0, 120]"),
        ({"prompt": "x", "response_format": "jpeg"}, 400, "response_format", "'jpeg'"),
        ({"prompt": "x", "model": "flux"}, 400, "model", "this server runs 'sd3'"),
        ({"prompt": "x", "frames": 5}, 400, "frames", "unknown field"),
        ({"prompt": 3}, 400, "prompt", "expected a string"),
        ({"steps": 2}, 400, "prompt", "required"),
        ({"prompt": "x", **big}, 400, "prompt", "not both"),
        ({**big, "guidance": 1.0}, 400, "pooled_prompt_embeds", "required by sd3"),
        ({**big, "pooled_prompt_embeds": [[0.0] * 8]}, 400, "negative_prompt_embeds",
         "required"),
        ({"prompt_embeds": [[[0.0] * 15] * 5], "pooled_prompt_embeds": [[0.0] * 8],
          "guidance": 1.0}, 400, "prompt_embeds", "expected [1, T, 16]"),
        ({"prompt_embeds": {"shape": [1, 5, 16], "dtype": "float32", "b64": "AAAA"},
          "pooled_prompt_embeds": [[0.0] * 8], "guidance": 1.0}, 400, "prompt_embeds.b64",
         "bytes"),
        ({"prompt_attention_mask": [[1]], "prompt_embeds": [[[0.0] * 16]]}, 400,
         "prompt_attention_mask", "unknown field"),
        ([1, 2], 400, None, "expected a JSON object"),
    ]


@pytest.mark.parametrize("body, status, param, words", _bad_cases())
def test_bad_requests_name_the_field(sd3, body, status, param, words):
    got, err = call(sd3.url, "POST", "/v1/images/generations", body)
    assert got == status, err
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"], err
    if param:
        assert err["error"]["message"].startswith(param), err


def _raw(url, method, path, headers, body=b""):
    host, port = url[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest(method, path)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.headers, json.loads(resp.read())
    finally:
        conn.close()


def test_bad_http_is_refused(sd3):
    path = "/v1/images/generations"
    # a body above --max-body-mib (1): refused before it is sent
    status, headers, err = _raw(sd3.url, "POST", path, {"Content-Type": "application/json",
                                                        "Content-Length": str(2 << 20)})
    assert status == 413 and "at most 1048576" in err["error"]["message"]
    assert headers["Connection"] == "close"
    status, _, err = _raw(sd3.url, "POST", path, {"Content-Type": "application/json"})
    assert status == 411 and err["error"]["code"] == "length_required"
    status, _, err = _raw(sd3.url, "POST", path, {"Content-Type": "text/plain",
                                                  "Content-Length": "2"}, b"{}")
    assert status == 415 and "application/json" in err["error"]["message"]
    for raw, words in ((b"{", "invalid JSON"), (b'{"prompt": "x", "guidance": NaN}',
                                                "NaN is not valid JSON")):
        status, _, err = _raw(sd3.url, "POST", path, {"Content-Type": "application/json",
                                                      "Content-Length": str(len(raw))}, raw)
        assert status == 400 and words in err["error"]["message"], err
    assert call(sd3.url, "POST", "/v1/videos/generations", {"prompt": "x"})[1]["error"][
        "code"] == "wrong_endpoint"
    assert call(sd3.url, "GET", "/v1/nothing")[0] == 404
    assert call(sd3.url, "GET", path)[0] == 405
    assert call(sd3.url, "GET", "/v1/jobs/gen-0123456789abcdef")[0] == 404
    # the server answers on after all of these
    assert call(sd3.url, "GET", "/health")[0] == 200


def test_nan_output_fails_alone_and_the_group_serves_on(sd3):
    huge = {"prompt_embeds": [[[3e38] * 16] * 5], "pooled_prompt_embeds": [[3e38] * 8],
            "guidance": 1.0, "steps": 1}
    status, err = call(sd3.url, "POST", "/v1/images/generations", huge)
    assert status == 500 and err["error"]["code"] == "nonfinite", err
    assert "NaN or infinite" in err["error"]["message"]
    status, result = call(sd3.url, "POST", "/v1/images/generations",
                          {"prompt": "after", "seed": 3})
    assert status == 200 and len(result["data"]) == 1


def long_request(**extra):
    """Seconds of work for the tiny 2-rank SD3 (a hundred steps at the largest size)."""
    return {"prompt": "slow", "size": "64x64", "steps": 100, "seed": 1, **extra}


def test_cancel_running_and_queued_jobs_with_progress_events(sd3):
    status, running = call(sd3.url, "POST", "/v1/images/generations",
                           long_request(**{"async": True}))
    assert status == 202, running
    status, queued = call(sd3.url, "POST", "/v1/images/generations",
                          long_request(**{"async": True, "size": "60x60"}))
    assert status == 202 and queued["status"] == "queued"
    events = []

    def listen():
        conn = http.client.HTTPConnection(*sd3.url[7:].split(":"), timeout=60)
        conn.request("GET", f"/v1/jobs/{running['id']}/events")
        resp = conn.getresponse()
        assert resp.headers["Content-Type"] == "text/event-stream"
        event = None
        for line in resp:
            line = line.decode().strip()
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, json.loads(line[6:])))
        conn.close()

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    wait_for(lambda: job(sd3.url, running["id"])["progress"]["step"] >= 2, 60,
             "the long job's second step")
    status, view = call(sd3.url, "DELETE", f"/v1/jobs/{queued['id']}")
    assert status == 200 and view["status"] == "cancelled"
    status, view = call(sd3.url, "POST", f"/v1/jobs/{running['id']}/cancel")
    assert status == 200 and view["status"] == "running"
    final = wait_for(lambda: (lambda j: j if j["status"] != "running" else None)(
        job(sd3.url, running["id"])), 60, "the cancel")
    assert final["status"] == "cancelled" and final["error"]["code"] == "cancelled"
    assert 2 <= final["progress"]["step"] < 100
    listener.join(30)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "cancelled" and kinds.count("cancelled") == 1, kinds
    steps = [d["progress"]["step"] for e, d in events if e == "progress"]
    assert steps == sorted(steps) and steps[-1] >= 2, steps
    assert job(sd3.url, queued["id"])["error"]["code"] == "cancelled"


def test_timeouts_answer_504(sd3):
    begin = time.monotonic()
    status, err = call(sd3.url, "POST", "/v1/images/generations", long_request(timeout=0.3, n=4))
    assert status == 504 and err["error"]["param"] == "timeout", err
    assert time.monotonic() - begin < 30
    status, view = call(sd3.url, "GET", f"/v1/jobs/{err['id']}")
    assert view["status"] == "failed" and view["progress"]["step"] < 100


def test_compatible_requests_run_as_one_batch(sd3):
    status, blocker = call(sd3.url, "POST", "/v1/images/generations",
                           long_request(**{"async": True}))
    assert status == 202
    wait_for(lambda: job(sd3.url, blocker["id"])["status"] == "running", 30, "the blocker")
    bodies = [{"prompt": "batch", "seed": 20, "async": True},
              {"prompt": "batch", "seed": 30, "n": 2, "async": True},
              {"prompt": "other", "seed": 40, "size": "8x8", "async": True}]
    ids = [call(sd3.url, "POST", "/v1/images/generations", b)[1]["id"] for b in bodies]
    views = [wait_for(lambda i=i: (lambda j: j if j["status"] == "succeeded" else None)(
        job(sd3.url, i)), 60, "the batch") for i in ids]
    assert [v["result"]["batch"] for v in views] == [
        {"requests": 2, "samples": 3, "calls": 1}, {"requests": 2, "samples": 3, "calls": 1},
        {"requests": 1, "samples": 1, "calls": 1}]
    images = [png_array(d["b64_json"]) for v in views for d in v["result"]["data"]]
    assert [im.shape for im in images] == [(12, 20, 3)] * 3 + [(8, 8, 3)]
    assert not np.array_equal(images[0], images[1]) and not np.array_equal(images[1], images[2])
    # a sample of a batch is the sample run alone (seed 30 + 1), up to the batch's rounding
    status, alone = call(sd3.url, "POST", "/v1/images/generations",
                         {"prompt": "batch", "seed": 31})
    diff = np.abs(png_array(alone["data"][0]["b64_json"]).astype(int) - images[2])
    assert diff.max() <= 2, diff.max()


LOAD_CLIENT = r"""
import json, sys, threading, time, urllib.error, urllib.request
url, clients, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
results, lock, counter = [], threading.Lock(), iter(range(total))
def client():
    while True:
        with lock:
            i = next(counter, None)
        if i is None:
            return
        body = json.dumps({"prompt": "load", "seed": 1000 + i, "steps": 1}).encode()
        req = urllib.request.Request(url + "/v1/images/generations", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                got = (r.status, json.load(r))
        except urllib.error.HTTPError as e:
            got = (e.code, json.load(e))
            time.sleep(0.02)  # refused: a moment before this client's next request
        except Exception as e:
            got = (None, repr(e))
        with lock:
            results.append((i, got[0], got[1]))
threads = [threading.Thread(target=client) for _ in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
json.dump(results, sys.stdout)
"""


def test_a_full_queue_refuses_with_429(sd3):
    status, blocker = call(sd3.url, "POST", "/v1/images/generations",
                           long_request(**{"async": True}))
    wait_for(lambda: job(sd3.url, blocker["id"])["status"] == "running", 30, "the blocker")
    queued = [call(sd3.url, "POST", "/v1/images/generations",
                   {"prompt": "q", "size": f"{4 * (i + 1)}x4", "async": True})[1]["id"]
              for i in range(4)]  # --max-queue 4 (the running job does not count)
    status, headers, raw = request(sd3.url, "POST", "/v1/images/generations",
                                   {"prompt": "one too many"})
    err = json.loads(raw)["error"]
    assert status == 429 and err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    assert "the queue is full (4 requests wait)" in err["message"]
    assert headers["Retry-After"] == "1" and metric(sd3.url, "queue_depth") == 4
    for job_id in queued + [blocker["id"]]:
        assert call(sd3.url, "DELETE", f"/v1/jobs/{job_id}")[0] == 200
    wait_for(lambda: job(sd3.url, blocker["id"])["status"] == "cancelled", 30, "the cancel")


def test_concurrent_clients_are_answered_or_refused_none_lost(sd3):
    done_before = metric(sd3.url, "jobs_total")
    proc = subprocess.Popen([sys.executable, "-c", LOAD_CLIENT, sd3.url, "8", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    results = json.loads(out)
    assert sorted(i for i, _, _ in results) == list(range(50))  # every request answered once
    codes = [status for _, status, _ in results]
    assert set(codes) <= {200, 429}, [r for r in results if r[1] not in (200, 429)][:3]
    ok = [(i, body) for i, status, body in results if status == 200]
    assert len(ok) >= 4, codes  # the first 4 at least find room in the queue
    ids = [body["id"] for _, body in ok]
    assert len(set(ids)) == len(ids)  # nothing duplicated
    assert all(body["seed"] == 1000 + i for i, body in ok)  # each its own request's answer
    refused = [body for _, status, body in results if status == 429]
    assert all(b["error"]["code"] == "queue_full" for b in refused)
    # the server made exactly the answered ones (a refused request made no job)
    assert metric(sd3.url, "jobs_total") - done_before == len(ok)
    images = {png_array(body["data"][0]["b64_json"]).tobytes() for _, body in ok}
    assert len(images) == len(ok)  # different seeds, different images: none swapped in twice


def test_the_client_example_runs(sd3, tmp_path):
    out = tmp_path / "fox.png"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "client.py"),
                           "--url", sd3.url, "--prompt", "a red fox", "--seed", "11",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sd3:" in proc.stdout and "text encoder: stand-in" in proc.stdout
    status, result = call(sd3.url, "POST", "/v1/images/generations",
                          {"prompt": "a red fox", "seed": 11})
    assert out.read_bytes() == base64.b64decode(result["data"][0]["b64_json"])


def test_graceful_shutdown_finishes_the_running_request(sd3):
    """Last of the module: SIGTERM to rank 0 while a request runs and another waits."""
    answers = {}

    def post(key, body):
        answers[key] = call(sd3.url, "POST", "/v1/images/generations", body, timeout=120)

    running = threading.Thread(target=post, args=("running", long_request(
        n=2, response_format="url")))
    running.start()
    wait_for(lambda: call(sd3.url, "GET", "/health")[1]["running"], 30, "the running job")
    queued = threading.Thread(target=post, args=("queued", {"prompt": "late"}))
    queued.start()
    wait_for(lambda: call(sd3.url, "GET", "/health")[1]["queue"] == 1, 30, "the queued job")
    rank0 = call(sd3.url, "GET", "/health")[1]["ranks"][0]["pid"]
    os.kill(rank0, signal.SIGTERM)
    queued.join(60)
    running.join(120)
    assert answers["queued"][0] == 503, answers["queued"]
    assert answers["queued"][1]["error"]["code"] == "shutting_down"
    status, result = answers["running"]
    assert status == 200, result
    assert sd3.wait(60) == 0, sd3.log()[-3000:]
    log = sd3.log()
    assert "shutting down (SIGTERM)" in log and "stopped: every rank told to exit" in log
    names = os.listdir(sd3.files)
    assert not [n for n in names if n.endswith(".part")], names  # nothing half-written
    from PIL import Image

    assert len(result["data"]) == 2
    for item in result["data"]:  # the finished request's files, whole
        with Image.open(sd3.files / item["url"].rsplit("/", 1)[1]) as im:
            assert im.size == (64, 64)


# ---- a 2-rank Wan server: a video, then a rank stops -----------------------------------------

GROUP_TIMEOUT_S = 10.0


def test_video_then_a_stopped_rank_ends_the_server_within_one_group_timeout(tmp_path):
    server = Served(["--pipeline", "wan", "--heartbeat", "0.5", "--group-timeout",
                     str(GROUP_TIMEOUT_S),
                     "--warmup", "1"], 2, tmp_path / "server.log")
    try:
        status, result = call(server.url, "POST", "/v1/videos/generations",
                              {"prompt": "a red fox", "seed": 7, "fps": 8})
        assert status == 200, result
        assert result["object"] == "video.generation" and result["frames"] == 9
        path = tmp_path / "video.mp4"
        path.write_bytes(base64.b64decode(result["data"][0]["b64_json"]))
        frames = np.stack(imageio.mimread(str(path)))
        assert frames.shape == (9, 48, 16, 3), frames.shape
        [direct] = run_direct([("wan", 48, 16, 9, 2, 5.0, 7, "a red fox")])
        # H.264 is lossy: the decoded frames are near the direct run's
        assert np.abs(frames.astype(int) - direct).mean() < 8
        status, gif = call(server.url, "POST", "/v1/videos/generations",
                           {"prompt": "a red fox", "seed": 7, "output_format": "gif"})
        assert status == 200 and base64.b64decode(gif["data"][0]["b64_json"])[:3] == b"GIF"

        health = call(server.url, "GET", "/health")[1]
        answer = {}

        def post():
            answer["got"] = request(server.url, "POST", "/v1/videos/generations",
                                    {"prompt": "slow", "steps": 100, "size": "128x128",
                                     "frames": 33}, timeout=120)

        client = threading.Thread(target=post)
        client.start()
        wait_for(lambda: running_step(server.url) >= 1, 60, "the running request's first step")
        begin = time.monotonic()
        os.kill(health["ranks"][1]["pid"], signal.SIGSTOP)  # alive, silent: only a timeout
        client.join(60)
        noticed = time.monotonic() - begin
        status, _, raw = answer.get("got", (None, None, b"{}"))
        assert status == 503 and json.loads(raw)["error"]["code"] == "group_failed", raw
        # one group timeout, not two (the data plane's, then the control plane's)
        assert GROUP_TIMEOUT_S * 0.9 < noticed < GROUP_TIMEOUT_S * 1.8, noticed
        os.kill(health["ranks"][1]["pid"], signal.SIGKILL)  # the launcher need not wait for it
        code = server.wait(60)
        assert code != 0
        log = server.log()
        assert "warm-up 1/1:" in log
        assert "the rank group failed" in log and "a rank died or stopped answering" in log
    finally:
        server.kill()


# ---- one rank: the shutdown grace runs out; the benchmark ----------------------------------

def test_shutdown_grace_stops_the_running_request(tmp_path):
    server = Served(["--pipeline", "flux", "--shutdown-grace", "0.3"], 1,
                    tmp_path / "server.log")
    try:
        status, result = call(server.url, "POST", "/v1/images/generations",
                              {"prompt": "a red fox", "n": 1, "seed": 2})
        assert status == 200 and result["model"] == "flux" and result["guidance"] == 1.0
        assert png_array(result["data"][0]["b64_json"]).shape == (12, 20, 3)
        answer = {}
        client = threading.Thread(target=lambda: answer.setdefault("got", call(
            server.url, "POST", "/v1/images/generations",
            {"prompt": "slow", "size": "256x256", "steps": 100}, timeout=120)))
        client.start()
        wait_for(lambda: running_step(server.url) >= 1, 60, "the running request's first step")
        server.proc.send_signal(signal.SIGTERM)
        client.join(60)
        status, err = answer["got"]
        assert status == 503 and err["error"]["code"] == "shutting_down", err
        assert "shut down before the request finished" in err["error"]["message"]
        assert server.wait(60) == 0, server.log()[-3000:]
    finally:
        server.kill()


def test_the_benchmark_runs_on_the_cpu(tmp_path):
    # with the experiment's options: a second direct loop idling 5 ms after each call, and the
    # busy-worker variant of the server (its answers are the stock server's)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serve.bench_serve", "--device", "cpu", "--size", "tiny",
         "--pipelines", "sd3", "--requests", "4", "--clients", "1,2", "--steps", "1",
         "--warmup", "1", "--max-s", "90", "--direct-gap-ms", "0,5",
         "--server-module", "bench.serve.busy_worker", "--out-dir", str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "serve.json").read_text())
    assert [(r["mode"], r["clients"], r.get("gap_ms")) for r in rows] == [
        ("direct", 1, 0.0), ("direct", 1, 5.0), ("server", 1, None), ("server", 2, None)]
    assert all(r["requests"] == 4 and r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"]
               for r in rows)
    assert rows[0]["call_p50_ms"] <= rows[0]["p50_ms"] and rows[3]["errors"] == 0
    assert rows[2]["same_output"] is True  # the server's image is the direct call's
    assert rows[2]["overhead"] == pytest.approx(rows[2]["p50_ms"] / rows[0]["p50_ms"] - 1)
    assert -0.9 < rows[2]["paired_overhead"] < 100
    table = (tmp_path / "serve.md").read_text()
    assert "| sd3 | 12x20 | 1 | server (bench.serve.busy_worker) | 1 | 4 |" in table
    assert "| sd3 | 12x20 | 1 | direct, 5 ms idle between calls | 1 | 4 |" in table
    assert proc.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # printed last


def test_the_profile_comparison_splits_the_two_sides(tmp_path):
    from bench.serve import pyspy_compare

    call = "FluxPipeline.__call__ (diffusers/pipelines/flux/pipeline_flux.py:900)"
    direct = "process 1:\"bench\";thread (1): MainThread;Bench.direct (bench/serve/bench_serve.py:240)"
    server = "process 2:\"serve\";thread (2): MainThread;execute (ditscale/serve/runner.py:129)"
    step = "FluxTransformer2DModel.forward (diffusers/models/transformers/transformer_flux.py:7)"
    profile = tmp_path / "p.txt"
    profile.write_text(f"{direct};{call};{step} 10\n{server};{call};{step} 12\n"
                       f"{server};{call};DiffusionPipeline._execution_device (x.py:1) 5\n"
                       f"{server};JobStore.next_batch (ditscale/serve/jobs.py:145) 99\n")
    totals, by_line, by_leaf = pyspy_compare.compare(str(profile), 1)
    assert totals == {"direct": 10, "server": 17}  # the idle worker's stack is not a call
    assert by_line["server"][step] == 12 and by_line["direct"][step] == 10
    assert by_leaf["server"]["DiffusionPipeline._execution_device (x.py:1)"] == 5
    profile.write_text("not a profile line\n")
    with pytest.raises(ValueError, match=r"p.txt:1: not a 'frames count' line"):
        pyspy_compare.compare(str(profile), 1)
