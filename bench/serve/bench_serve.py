#!/usr/bin/env python3
"""What ``python -m ditscale.serve`` costs over calling the pipeline directly, and what it
serves under concurrent clients, on one device (one rank).

    python -m bench.serve.bench_serve [--pipelines flux,wan] [--size small] [--device cuda]
        [--steps N] [--clients 1,4,16] [--requests 32] [--max-s 180] [--out-dir DIR]

Per pipeline: the server (``--max-batch 1``) and, in this process, the same pipeline built the
same way (``cli.build_pipeline``). Phases: direct calls (with the server's output path: NaN
check, ``to_uint8``, PNG / video encoding); one client alternating with the direct loop
(overhead = server p50 / direct p50 - 1, and the median of paired ratios); C closed-loop
clients (requests/s, p50 / p99). ``--max-s`` bounds the run (counts shrink, never below 4;
skipped phases are logged). Rows: DIR/serve.json; the table: DIR/serve.md, printed last.
``--device cpu --size tiny`` is the CI smoke test. docs/serve.md has the results.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from bench.common import REPO

PIPELINES = ("flux", "sd3", "wan", "wan2.2", "hunyuan-video", "cogvideox")
PROMPT = "a red fox running through fresh snow"
STEM = "serve"
MIN_REQUESTS = 4  # per phase, whatever --max-s says (fewer: no p50 worth the name)


# ---- options ------------------------------------------------------------------------------

def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", default="flux,wan", help=f"comma-separated, of "
                    f"{', '.join(PIPELINES)}")
    ap.add_argument("--size", choices=("tiny", "small", "full"), default="small")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--steps", type=int, default=None,
                    help="[1, 1000] (default: the server's, 30 small/full, 2 tiny)")
    ap.add_argument("--height", type=int, default=None, help="[8, 16384] (default: the size's)")
    ap.add_argument("--width", type=int, default=None, help="[8, 16384] (default: the size's)")
    ap.add_argument("--frames", type=int, default=None,
                    help="videos, [1, 1025] (default: the size's)")
    ap.add_argument("--clients", default="1,4,16", help="concurrent clients, each in [1, 256]")
    ap.add_argument("--requests", type=int, default=32, help="requests per phase, [1, 10000]")
    ap.add_argument("--rounds", type=int, default=None,
                    help="alternating direct / 1-client rounds, [1, 10000] (default: one call "
                         "of each per round, the finest alternation)")
    ap.add_argument("--warmup", type=int, default=2, help="calls of each before timing, [0, 100]")
    ap.add_argument("--response-format", choices=("b64_json", "url"), default="b64_json")
    ap.add_argument("--direct-gap-ms", default="0",
                    help="idle ms after each direct call, comma-separated, each in [0, 10000]: "
                         "a direct row per gap, all in the same alternating rounds (the server "
                         "at 1 client idles between requests: this tells whether the idle "
                         "alone slows the next call); the overhead is against the first")
    ap.add_argument("--server-module", default="ditscale.serve",
                    help="the module run as the server (python -m MODULE): an experiment's "
                         "variant of ditscale.serve, e.g. bench.serve.busy_worker")
    ap.add_argument("--video-format", choices=("mp4", "gif"), default="mp4",
                    help="the videos' container, server and direct alike (mp4 needs "
                         "imageio-ffmpeg)")
    ap.add_argument("--max-s", type=float, default=180.0,
                    help="seconds for the whole run, (0, 3600]")
    ap.add_argument("--startup-s", type=float, default=300.0,
                    help="seconds a server may take to listen, (0, 1800]")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    args.pipelines = [p for p in args.pipelines.split(",") if p]
    bad = [p for p in args.pipelines if p not in PIPELINES]
    if not args.pipelines or bad:
        ap.error(f"--pipelines: {bad or args.pipelines} not in {', '.join(PIPELINES)}")
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c]
    except ValueError:
        ap.error(f"--clients: {args.clients!r} is not a comma-separated list of integers")
    if not args.clients or any(not 1 <= c <= 256 for c in args.clients):
        ap.error(f"--clients: {args.clients} must each be in [1, 256]")
    for name, lo, hi in (("steps", 1, 1000), ("height", 8, 16384), ("width", 8, 16384),
                         ("frames", 1, 1025), ("requests", 1, 10000), ("rounds", 1, 10000),
                         ("warmup", 0, 100)):
        v = getattr(args, name)
        if v is not None and not lo <= v <= hi:
            ap.error(f"--{name}: {v} is out of range [{lo}, {hi}]")
    for name, hi in (("max_s", 3600.0), ("startup_s", 1800.0)):
        v = getattr(args, name)
        if not (math.isfinite(v) and 0 < v <= hi):
            ap.error(f"--{name.replace('_', '-')}: {v:g} is out of range (0, {hi:g}]")
    try:
        args.direct_gap_ms = [float(g) for g in args.direct_gap_ms.split(",") if g]
    except ValueError:
        ap.error(f"--direct-gap-ms: {args.direct_gap_ms!r} is not a comma-separated list of "
                 f"numbers")
    if not args.direct_gap_ms or any(not (math.isfinite(g) and 0 <= g <= 10000)
                                     for g in args.direct_gap_ms):
        ap.error(f"--direct-gap-ms: {args.direct_gap_ms} must each be in [0, 10000]")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", args.server_module):
        ap.error(f"--server-module: {args.server_module!r} is not a module name")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


# ---- the server ---------------------------------------------------------------------------

def _env() -> dict:
    import ditscale

    env = dict(os.environ)
    package_dir = os.path.dirname(os.path.dirname(ditscale.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_dir, str(REPO),
                                                    env.get("PYTHONPATH")) if p)
    return env


class Server:
    """``python -m ditscale.serve`` in a child process; ``url`` once ``listening()``."""

    def __init__(self, module: str, argv, log_dir: str):
        self.log_path = os.path.join(log_dir, "server.log")
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", module] + argv,
                                     env=_env(), stdout=self.log_file,
                                     stderr=subprocess.STDOUT)
        self.url = None

    def log(self, tail: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-tail:]

    def listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log(1 << 20).splitlines():
                if "ditscale.serve: listening on http://" in line:
                    self.url = line.split("listening on ")[1].split()[0]
                    return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not listen within {timeout:g} s:\n"
                                   f"{self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: it exits by itself
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log_file.close()


def post(url: str, path: str, body: dict, timeout: float = 600.0):
    """(latency s, status, parsed answer) of one request on a fresh connection."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    begin = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, answer = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, answer = e.code, json.loads(e.read() or b"{}")
    return time.perf_counter() - begin, status, answer


# ---- one pipeline -------------------------------------------------------------------------

class Bench:
    def __init__(self, name: str, args):
        from ditscale.diffusers import tiny

        self.name, self.args = name, args
        self.video = name in tiny.VIDEO_PIPELINES
        h, w, f = tiny.DEFAULT_SHAPES[name][args.size]
        self.height, self.width = args.height or h, args.width or w
        self.frames = (args.frames or f) if self.video else 1
        self.argv = ["--pipeline", name, "--size", args.size, "--device", args.device,
                     "--dtype", args.dtype, "--port", "0", "--max-batch", "1",
                     "--max-queue", str(2 * max(args.clients) + 2)]
        if args.steps is not None:
            self.argv += ["--steps", str(args.steps), "--max-steps", str(max(args.steps, 100))]
        self.seed = 0

    # -- the direct side --------------------------------------------------------------------

    def build_direct(self):
        import torch

        from ditscale.diffusers import generation
        from ditscale.serve import cli, options, runner

        opts = options.parse(self.argv, torch.cuda.is_available())
        device = generation.init_distributed(opts.device)
        self.pipe = cli.build_pipeline(opts, device)
        self.limits = cli.limits_of(self.pipe, opts)
        self.steps, self.guidance = opts.steps, self.limits.default_guidance
        self.embeds = runner.stand_in_embeds(self.pipe, [generation.stand_in_seed(PROMPT, "")],
                                             opts.text_tokens, self.guidance > 1)
        self.png_level, self.device = opts.png_level, device

    def direct(self):
        """(call s, call+encode s) of one direct call with the next seed."""
        import torch

        from ditscale.diffusers import generation

        self.seed += 1
        kw = generation.call_kwargs(
            self.name, height=self.height, width=self.width, frames=self.frames,
            steps=self.steps, guidance=self.guidance, seeds=[self.seed], device=self.device,
            embeds=self.embeds)
        begin = time.perf_counter()
        with torch.no_grad():
            array = generation.output_array(self.pipe(**kw), self.video)
        called = time.perf_counter() - begin
        if generation.nonfinite(array):
            raise RuntimeError("the direct call's output has NaN or infinite values")
        samples = generation.to_uint8(array)
        if self.video:
            data = generation.encode_video(samples[0], 16, self.args.video_format)
        else:
            data = generation.encode_png(samples[0], self.png_level)
        self.last_direct = (self.seed, samples[0], data)
        return called, time.perf_counter() - begin

    # -- the server side --------------------------------------------------------------------

    def body(self) -> dict:
        self.seed += 1
        body = {"prompt": PROMPT, "seed": self.seed, "steps": self.steps,
                "size": f"{self.width}x{self.height}",
                "response_format": self.args.response_format}
        if self.video:
            body["frames"] = self.frames
            body["output_format"] = self.args.video_format
        return body

    def request(self):
        """(latency s, the answer) of one request; an error answer raises."""
        kind = "videos" if self.video else "images"
        latency, status, answer = post(self.url, f"/v1/{kind}/generations", self.body())
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {answer.get('error', answer)}")
        return latency, answer

    def clients(self, count: int, total: int):
        """C closed-loop clients, ``total`` requests in all: (wall s, latencies, answers)."""
        per = [total // count + (i < total % count) for i in range(count)]
        bodies = [[self.body() for _ in range(n)] for n in per]
        kind = "videos" if self.video else "images"
        results, errors, lock = [], [], threading.Lock()
        start = threading.Barrier(count + 1)

        def client(mine):
            start.wait()
            for body in mine:
                try:
                    latency, status, answer = post(self.url, f"/v1/{kind}/generations", body)
                except Exception as e:  # noqa: BLE001 - counted, reported in the row
                    status, answer, latency = None, {"error": repr(e)}, 0.0
                with lock:
                    if status == 200:
                        results.append((latency, answer))
                    else:
                        errors.append(f"{status}: {answer.get('error', answer)}"[:200])

        threads = [threading.Thread(target=client, args=(b,), daemon=True) for b in bodies]
        for t in threads:
            t.start()
        start.wait()
        begin = time.perf_counter()
        for t in threads:
            t.join()
        return time.perf_counter() - begin, results, errors


def pct(values, q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(latencies) -> dict:
    return {"requests": len(latencies), "p50_ms": 1e3 * pct(latencies, 0.5),
            "p99_ms": 1e3 * pct(latencies, 0.99), "mean_ms": 1e3 * statistics.fmean(latencies)}


def server_timings(answers) -> dict:
    """Mean of the server's own timings (its pipeline call and its stages, its encoding)."""
    keys = ("run_s", "text_encoding_s", "denoising_s", "vae_decode_s", "encode_s")
    return {f"server_{k}_ms": 1e3 * statistics.fmean(a["timings"].get(k, 0.0) for a in answers)
            for k in keys}


def run_pipeline(name: str, args, deadline: float, log_dir: str, rows: list) -> None:
    """Appends the rows of ``name`` (see the module) to ``rows`` as they are measured."""
    b = Bench(name, args)
    shape = f"{b.height}x{b.width}" + (f"x{b.frames}" if b.video else "")
    server = Server(args.server_module, b.argv, log_dir)

    def log(msg):
        print(f"[serve {name}] {msg}", file=sys.stderr, flush=True)

    try:
        b.build_direct()  # while the server starts
        b.url = server.listening(max(1.0, min(args.startup_s, deadline - time.monotonic())))
        common = {"pipeline": name, "size": args.size, "shape": shape, "steps": b.steps,
                  "guidance": b.guidance, "device": args.device, "dtype": args.dtype}
        for _ in range(args.warmup):
            b.direct()
            b.request()
        n, each = _counts(b, args, deadline, log)
        rows += _alternating(b, args, n, each, deadline, common, log)
        for count in args.clients:
            if count > 1:
                rows.append(_concurrent(b, count, n, each, deadline, common, log))
        memory = _peak_memory(b.url)
        for row in rows:
            if row["pipeline"] == name and row["mode"] == "server":
                row["server_peak_gib"] = memory
    finally:
        server.stop()


def _counts(b: Bench, args, deadline: float, log):
    """(requests per phase, seconds a request): from one more call of each, the counts the
    budget allows (each phase takes about n requests' time: the clients share one device)."""
    each = (b.direct()[1] + b.request()[0]) / 2
    phases = 2 + len([c for c in args.clients if c > 1])  # direct + 1 client + the others
    left = deadline - time.monotonic()
    n = max(MIN_REQUESTS, min(args.requests, int(left / (phases * each))))
    if n < args.requests:
        log(f"--requests {args.requests} -> {n} per phase (--max-s: {left:.0f} s left, "
            f"{each:.3f} s a request)")
    return n, each


def _alternating(b: Bench, args, n: int, each: float, deadline: float, common: dict, log):
    """The direct rows (one loop per gap) and the 1-client row, measured in alternating
    rounds (at least one; no new round past the budget)."""
    same = _same_output(b)
    gaps = args.direct_gap_ms
    calls, wholes = [[] for _ in gaps], [[] for _ in gaps]
    latencies, answers = [], []
    rounds = n if args.rounds is None else min(args.rounds, n)
    if rounds != (args.rounds or n):
        log(f"--rounds {args.rounds} -> {rounds} (one call of each a round at least)")
    per_round = [n // rounds + (i < n % rounds) for i in range(rounds)]
    for i, k in enumerate(per_round):
        if i and time.monotonic() + (len(gaps) + 1) * k * each > deadline:
            log(f"rounds {i + 1}-{rounds} left out (--max-s)")
            break
        for g, gap in enumerate(gaps):
            for _ in range(k):
                call, whole = b.direct()
                calls[g].append(call)
                wholes[g].append(whole)
                time.sleep(gap / 1e3)  # outside the timed call
        for _ in range(k):
            latency, answer = b.request()
            latencies.append(latency)
            answers.append(answer)
    directs = [{**common, "mode": "direct", "clients": 1, **summary(w), "gap_ms": gap,
                "call_p50_ms": 1e3 * pct(c, 0.5), "call_p99_ms": 1e3 * pct(c, 0.99),
                "req_per_s": len(w) / sum(w)}
               for gap, c, w in zip(gaps, calls, wholes)]
    one = {**common, "mode": "server", "clients": 1, **summary(latencies),
           "req_per_s": len(latencies) / sum(latencies), **server_timings(answers),
           "same_output": same}
    one["overhead"] = one["p50_ms"] / directs[0]["p50_ms"] - 1
    # the i-th request against the i-th direct call of the same round: the host's drift
    # between rounds cancels
    one["paired_overhead"] = statistics.median(
        s / d for s, d in zip(latencies, wholes[0])) - 1
    for d in directs[1:]:
        log(f"direct with {d['gap_ms']:g} ms idle after each call: p50 {d['p50_ms']:.1f} ms "
            f"(call {d['call_p50_ms']:.1f})")
    log(f"direct p50 {directs[0]['p50_ms']:.1f} ms (call {directs[0]['call_p50_ms']:.1f}), "
        f"server p50 {one['p50_ms']:.1f} ms: overhead {100 * one['overhead']:+.2f}% "
        f"(paired {100 * one['paired_overhead']:+.2f}%)")
    return directs + [one]


def _concurrent(b: Bench, count: int, n: int, each: float, deadline: float, common: dict,
                log) -> dict:
    """The row of ``count`` closed-loop clients (skipped: more clients than requests, or no
    budget left)."""
    row = {**common, "mode": "server", "clients": count}
    if count > n or time.monotonic() + n * each > deadline + 0.25 * n * each:
        row["skipped"] = (f"{count} clients > {n} requests" if count > n
                          else "--max-s spent")
        log(f"{count} clients: skipped ({row['skipped']})")
        return row
    wall, results, errors = b.clients(count, n)
    row["errors"] = len(errors)
    if results:
        row.update(summary([r[0] for r in results]))
        row.update(server_timings([r[1] for r in results]))
        row["req_per_s"] = len(results) / wall
    if errors:
        row["error"] = errors[0]
    log(f"{count} clients: {row.get('req_per_s', 0):.2f} req/s, p50 "
        f"{row.get('p50_ms', 0):.1f} ms, p99 {row.get('p99_ms', 0):.1f} ms"
        + (f", {len(errors)} errors" if errors else ""))
    return row


def _same_output(b: Bench):
    """Whether the server's image for a seed is the direct call's (images, b64_json); None
    where it cannot say (videos: MP4 is lossy; url answers)."""
    if b.video or b.args.response_format != "b64_json":
        return None
    seed, sample, data = b.last_direct
    body = b.body()
    body["seed"] = seed
    _, status, answer = post(b.url, "/v1/images/generations", body)
    return status == 200 and base64.b64decode(answer["data"][0]["b64_json"]) == data


def _peak_memory(url: str):
    """The server's peak device memory of its last batch (GiB), from /metrics."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("ditscale_serve_gpu_memory_bytes") and 'kind="peak"' in line:
            return round(float(line.rsplit(" ", 1)[1]) / 2**30, 3)
    return None


# ---- the table ----------------------------------------------------------------------------

def table(rows, args) -> str:
    def ms(row, key):
        return f"{row[key]:.1f}" if key in row else ""

    def mode(row):
        if row.get("gap_ms"):
            return f"direct, {row['gap_ms']:g} ms idle between calls"
        if row["mode"] == "server" and args.server_module != "ditscale.serve":
            return f"server ({args.server_module})"
        return row["mode"]

    lines = [f"# ditscale.serve against the pipeline called directly ({args.device}, "
             f"{args.dtype}, size {args.size}, response {args.response_format})", "",
             "| pipeline | shape | steps | mode | clients | requests | req/s | p50 ms | "
             "p99 ms | call p50 ms | server run ms | overhead | paired | same output |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['pipeline']} | {r.get('shape', '')} | {r.get('steps', '')} | "
                f"{mode(r)} | {r.get('clients', '')} |")
        if "p50_ms" not in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r.get('error')}"
            lines.append(f"{head} {what} |" + " |" * 8)
            continue
        over = f"{100 * r['overhead']:+.2f}%" if "overhead" in r else ""
        paired = f"{100 * r['paired_overhead']:+.2f}%" if "paired_overhead" in r else ""
        same = {True: "yes", False: "NO", None: ""}[r.get("same_output")]
        lines.append(f"{head} {r['requests']} | {r['req_per_s']:.2f} | {ms(r, 'p50_ms')} | "
                     f"{ms(r, 'p99_ms')} | {ms(r, 'call_p50_ms')} | {ms(r, 'server_run_s_ms')} | "
                     f"{over} | {paired} | {same} |")
    lines += ["", "direct: the pipeline call + NaN check + to_uint8 + PNG / MP4 encoding, one "
              "call after another (call: the pipeline call alone); server: submission to "
              "parsed JSON answer over loopback HTTP, closed-loop clients (server run: its "
              "pipeline call); overhead: server p50 / direct p50 - 1 at 1 client (target "
              "< 3%); paired: the median of request i / direct call i - 1 (alternating); "
              "same output: the server's PNG of a seed has the direct call's bytes."]
    errors = [r for r in rows if "error" in r and "p50_ms" in r]
    lines += [f"- {r['pipeline']} {r['clients']} clients: {r['errors']} failed requests, e.g. "
              f"{r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


class Interrupted(Exception):
    """SIGTERM (a lease's timeout): the rows so far are written."""


def _on_term(signum, frame):
    raise Interrupted(f"interrupted by {signal.Signals(signum).name}")


def write(rows, args) -> str:
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{STEM}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    text = table(rows, args)
    with open(os.path.join(args.out_dir, f"{STEM}.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    args = parse(argv)
    deadline = time.monotonic() + args.max_s
    signal.signal(signal.SIGTERM, _on_term)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as log_dir:
        for i, name in enumerate(args.pipelines):
            # an equal share of what is left for each pipeline still to run
            share = (deadline - time.monotonic()) / (len(args.pipelines) - i)
            try:
                run_pipeline(name, args, time.monotonic() + share, log_dir, rows)
            except Exception as e:  # noqa: BLE001 - one failed pipeline keeps the others' rows
                rows.append({"pipeline": name, "mode": "server", "error":
                             f"{type(e).__name__}: {e}"[:2000]})
                print(f"[serve {name}] {rows[-1]['error']}", file=sys.stderr, flush=True)
                if isinstance(e, Interrupted):
                    break
            finally:
                write(rows, args)  # what is measured survives a later failure
    print(write(rows, args))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
