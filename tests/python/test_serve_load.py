"""python -m ditscale.serve under hostile input and load, on one CPU rank (the tiny SD3).

One server process (the module's fixture, ``--read-timeout 2``, ``--max-batch 2``) answers
every test, in file order: request bodies that used to crash or stall the server (a lone
surrogate, 400-digit numbers, a list as dtype, bad Content-Length framing), ``n`` above the
batch limit, a synchronous client that disconnects (its job is cancelled), 300 connections
that trickle their headers (``/health`` answers meanwhile; each is closed at its deadline),
connections beyond ``--max-connections`` (503 until the idle ones are closed), the
per-stage timings, the OpenAPI schema and an OpenAI-client-shaped request (httpx), and a
bounded load test: concurrent, trickling and disconnecting clients at once, every request
answered once or refused with 429, nothing lost. Every socket has a timeout; the server is
killed in a finally.
"""

import json
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
httpx = pytest.importorskip("httpx")

from test_serve import Served, call, job, metric, png_array, request, wait_for  # noqa: E402

from ditscale.serve.body import ErrorBody, GenerationResult, JobView  # noqa: E402

READ_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 400
ARGS = ["--pipeline", "sd3", "--max-batch", "2", "--max-queue", "8", "--heartbeat", "0.5",
        "--read-timeout", str(READ_TIMEOUT_S), "--request-timeout", "120",
        "--max-connections", str(MAX_CONNECTIONS)]
PATH = "/v1/images/generations"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-load")
    served = Served(ARGS, 1, folder / "server.log")
    try:
        yield served
    finally:
        served.kill()


def _address(url):
    host, port = url[len("http://"):].split(":")
    return host, int(port)


def raw_exchange(url, data: bytes, timeout=30.0) -> bytes:
    """Sends ``data`` on a new connection; everything the server answers until it closes."""
    with socket.create_connection(_address(url), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def raw_post(body: bytes, headers=b"") -> bytes:
    return (b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n" + headers + b"\r\n" + body)


def status_and_error(answer: bytes):
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def long_body(**extra):
    return {"prompt": "slow", "size": "64x64", "steps": 100, "seed": 1, **extra}


# ---- one bad request fails alone ------------------------------------------------------------

@pytest.mark.parametrize("raw, param, words", [
    (b'{"prompt": "\\ud800"}', "prompt", "not valid Unicode"),
    (b'{"prompt": "x", "negative_prompt": "a\\udfff"}', "negative_prompt", "not valid Unicode"),
    (b'{"prompt": "x", "guidance": 1' + b"0" * 400 + b"}", "guidance", "401-digit integer"),
    (b'{"prompt": "x", "timeout": 9' + b"9" * 399 + b"}", "timeout", "400-digit integer"),
    (b'{"prompt": "x", "steps": 1' + b"0" * 400 + b"}", "steps", "out of range [1, 100]"),
    (b'{"prompt_embeds": {"shape": [1, 2, 16], "dtype": ["float32"], "b64": ""}}',
     "prompt_embeds.dtype", "is not one of"),
    (b'{"prompt_embeds": [[[0.0]]], "pooled_prompt_embeds": {"shape": [1, 8], "x": 1}}',
     "pooled_prompt_embeds.x", "unknown field"),
])
def test_hostile_fields_fail_alone_naming_the_field(server, raw, param, words):
    status, queued = call(server.url, "POST", PATH, {"prompt": "kept", "seed": 4,
                                                     "async": True})
    assert status == 202
    status, err = status_and_error(raw_exchange(
        server.url, raw_post(raw, b"Content-Length: %d\r\n" % len(raw))))
    assert status == 400 and err["param"] == param, err
    assert err["message"].startswith(param + ":") and words in err["message"], err
    ErrorBody.model_validate({"error": err})
    JobView.model_validate(queued)
    # the queued job is not lost, and the server serves on
    final = wait_for(lambda: (lambda j: j if j["status"] != "queued" and j["status"] !=
                              "running" else None)(job(server.url, queued["id"])), 60, "the job")
    assert final["status"] == "succeeded", final
    JobView.model_validate(final)  # the answers are what /openapi.json says
    assert call(server.url, "GET", "/health")[1]["status"] == "ok"


@pytest.mark.parametrize("headers", [
    b"Content-Length: 2\r\nContent-Length: 3\r\n",  # conflicting
    "Content-Length: \u0663\r\n".encode(),  # a non-ASCII digit
    b"Content-Length: 2x\r\n",
])
def test_bad_content_length_is_a_400_with_the_error_body(server, headers):
    status, err = status_and_error(raw_exchange(server.url, raw_post(b"{}", headers)))
    assert status == 400 and err["code"] == "invalid_http", err
    assert err["type"] == "invalid_request_error" and "Content-Length" in err["message"]


# ---- n above the batch limit; a disconnected client ---------------------------------------

def test_n_above_the_batch_limit_runs_in_several_calls(server):
    status, result = call(server.url, "POST", PATH, {"prompt": "many", "seed": 50, "n": 3})
    assert status == 200, result
    assert result["batch"] == {"requests": 1, "samples": 3, "calls": 2}
    images = [png_array(d["b64_json"]) for d in result["data"]]
    status, alone = call(server.url, "POST", PATH, {"prompt": "many", "seed": 52})
    diff = np.abs(png_array(alone["data"][0]["b64_json"]).astype(int) - images[2])
    assert diff.max() <= 2, diff.max()  # sample 2 is seed 52, up to a batch's rounding


def test_a_disconnected_synchronous_client_cancels_its_job(server):
    body = json.dumps(long_body()).encode()
    with socket.create_connection(_address(server.url), timeout=30) as s:
        s.sendall(raw_post(body, b"Content-Length: %d\r\n" % len(body)))
        running = wait_for(lambda: call(server.url, "GET", "/health")[1]["running"], 60,
                           "the job to run")
    final = wait_for(lambda: (lambda j: j if j["status"] != "running" else None)(
        job(server.url, running[0])), 60, "the cancel")
    assert final["status"] == "cancelled" and final["progress"]["step"] < 100, final


# ---- slow clients -----------------------------------------------------------------------------

def test_trickling_clients_neither_block_health_nor_hold_connections(server):
    conns = []
    try:
        for _ in range(300):
            s = socket.create_connection(_address(server.url), timeout=10)
            s.sendall(b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: x\r\n")
            conns.append(s)
        begin = time.monotonic()
        latencies = []
        while time.monotonic() - begin < READ_TIMEOUT_S * 0.8:
            for s in conns[::25]:
                s.sendall(b"X")  # a byte of a header line: the client is alive, and slow
            t = time.monotonic()
            assert call(server.url, "GET", "/health", timeout=10)[0] == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.1)
        assert max(latencies) < 2.0, latencies
        time.sleep(READ_TIMEOUT_S * 1.5)
        closed = 0
        for s in conns:  # every one closed by the server at its deadline
            s.settimeout(5)
            try:
                closed += s.recv(1024) == b""
            except OSError:
                closed += 1
        assert closed == len(conns)
    finally:
        for s in conns:
            s.close()


def test_a_body_that_does_not_arrive_in_time_is_dropped(server):
    jobs_before = metric(server.url, "jobs_total") + metric(server.url, "queue_depth")
    body = json.dumps({"prompt": "late", "steps": 1}).encode()
    with socket.create_connection(_address(server.url), timeout=30) as s:
        s.sendall(raw_post(body[:10], b"Content-Length: %d\r\n" % len(body)))
        begin = time.monotonic()
        assert s.recv(1024) == b""  # closed at the deadline, unanswered
        assert READ_TIMEOUT_S * 0.5 < time.monotonic() - begin < READ_TIMEOUT_S * 3
    assert metric(server.url, "jobs_total") + metric(server.url, "queue_depth") == jobs_before


def test_connections_beyond_the_limit_get_503_until_the_idle_ones_are_closed(server):
    conns = []
    try:
        for _ in range(MAX_CONNECTIONS):
            conns.append(socket.create_connection(_address(server.url), timeout=10))
        time.sleep(0.2)
        status, headers, raw = request(server.url, "GET", "/health", timeout=10)
        assert status == 503 and headers["Retry-After"] == "1", raw
        assert json.loads(raw)["error"]["code"] == "too_many_connections"
        time.sleep(READ_TIMEOUT_S * 1.5)  # the silent ones are closed at their deadline
        assert call(server.url, "GET", "/health", timeout=10)[0] == 200
    finally:
        for s in conns:
            s.close()


# ---- timings, the schema, an OpenAI-shaped client ---------------------------------------------

def test_timings_per_stage_in_the_response_and_the_metrics(server):
    status, result = call(server.url, "POST", PATH, {"prompt": "timed", "steps": 3, "seed": 8})
    assert status == 200, result
    GenerationResult.model_validate(result)
    t = result["timings"]
    assert len(t["denoising_steps_s"]) == 3 and all(s > 0 for s in t["denoising_steps_s"])
    assert t["denoising_s"] >= sum(t["denoising_steps_s"]) - 1e-5  # and the step decisions
    assert t["vae_decode_s"] > 0 and t["output_encoding_s"] > 0 and t["text_encoding_s"] >= 0
    assert t["run_s"] >= t["denoising_s"] + t["vae_decode_s"]
    _, _, raw = request(server.url, "GET", "/metrics")
    text = raw.decode()
    for stage in ("text_encoding", "denoising_step", "vae_decode", "output_encoding"):
        assert f'ditscale_serve_stage_seconds_count{{stage="{stage}"}}' in text, stage


def test_openapi_and_an_openai_shaped_request(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        schema = client.get("/openapi.json").json()
        assert "/v1/images/generations" in schema["paths"]
        body = schema["components"]["schemas"]["ImageBody"]
        assert {"prompt", "n", "size", "response_format", "async"} <= set(body["properties"])
        assert client.get("/docs").status_code == 200
        # what openai's images.generate(model=..., prompt=..., n=2, size=...) sends
        r = client.post(PATH, json={"model": "sd3", "prompt": "a red fox", "n": 2,
                                    "size": "20x12", "response_format": "b64_json"},
                        headers={"Authorization": "Bearer unused", "OpenAI-Beta": "x"})
        assert r.status_code == 200, r.text
        assert [png_array(d["b64_json"]).shape for d in r.json()["data"]] == [(12, 20, 3)] * 2
        GenerationResult.model_validate(r.json())
        r = client.post(PATH, json={"prompt": "x", "size": "1024x1024"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "size"
        ErrorBody.model_validate(r.json())
        answers = schema["paths"][PATH]["post"]["responses"]
        assert answers["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/GenerationResult")


# ---- a bounded load test ----------------------------------------------------------------------

def _fast_client(url, ids, results, lock):
    while True:
        with lock:
            i = next(ids, None)
        if i is None:
            return
        body = {"prompt": "load", "seed": 1000 + i, "steps": 1}
        status, _, raw = request(url, "POST", PATH, body, timeout=120)
        with lock:
            results.append((i, status, json.loads(raw)))
        if status == 429:
            time.sleep(0.05)


def _trickling_client(url, pause_s, answers, lock):
    """A body sent a few bytes at a time, in ``pause_s`` steps: answered within the read
    deadline, dropped (no answer, no job) beyond it."""
    body = json.dumps({"prompt": "trickle", "steps": 1, "seed": 7}).encode()
    data = raw_post(body, b"Content-Length: %d\r\n" % len(body))
    try:
        with socket.create_connection(_address(url), timeout=60) as s:
            for k in range(0, len(data), len(data) // 4 + 1):
                s.sendall(data[k:k + len(data) // 4 + 1])
                time.sleep(pause_s)
            answer = s.recv(1 << 20)
    except OSError:
        answer = b""
    with lock:
        answers.append((pause_s, answer[:12]))


def _disconnecting_client(url):
    body = json.dumps({"prompt": "gone", "steps": 50, "size": "32x32"}).encode()
    with socket.create_connection(_address(url), timeout=30) as s:
        s.sendall(raw_post(body, b"Content-Length: %d\r\n" % len(body)))
        time.sleep(0.2)


def test_load_concurrent_slow_and_disconnecting_clients(server):
    done_before = metric(server.url, "jobs_total")
    results, answers, lock, ids = [], [], threading.Lock(), iter(range(40))
    threads = [threading.Thread(target=_fast_client, args=(server.url, ids, results, lock))
               for _ in range(6)]
    threads += [threading.Thread(target=_trickling_client,
                                 args=(server.url, pause, answers, lock))
                for pause in (0.05, 0.05, READ_TIMEOUT_S, READ_TIMEOUT_S)]
    threads += [threading.Thread(target=_disconnecting_client, args=(server.url,))
                for _ in range(4)]
    health = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        begin = time.monotonic()
        health.append((call(server.url, "GET", "/health", timeout=10)[0],
                       time.monotonic() - begin))
        time.sleep(0.2)
    for t in threads:
        t.join(5)
    assert all(status == 200 for status, _ in health) and max(s for _, s in health) < 3.0
    assert sorted(i for i, _, _ in results) == list(range(40))  # every one answered once
    assert {status for _, status, _ in results} <= {200, 429}
    ok = [(i, body) for i, status, body in results if status == 200]
    assert ok and all(body["seed"] == 1000 + i for i, body in ok)
    assert len({body["id"] for _, body in ok}) == len(ok)  # nothing duplicated
    fast = sorted(a for p, a in answers if p < READ_TIMEOUT_S)
    slow = [a for p, a in answers if p >= READ_TIMEOUT_S]
    assert all(a.startswith((b"HTTP/1.1 200", b"HTTP/1.1 429")) for a in fast), fast
    assert slow == [b"", b""], slow  # past the deadline: closed, never run
    # the disconnected clients' jobs (if the queue took them) end, cancelled or done, and no
    # other job was made: every job is an answered request's, counted once
    wait_for(lambda: not call(server.url, "GET", "/health")[1]["running"]
             and call(server.url, "GET", "/health")[1]["queue"] == 0, 60, "an idle server")
    made = metric(server.url, "jobs_total") - done_before
    trickled = sum(a.startswith(b"HTTP/1.1 200") for a in fast)
    assert len(ok) + trickled <= made <= len(ok) + trickled + 4, (made, len(ok), trickled)
