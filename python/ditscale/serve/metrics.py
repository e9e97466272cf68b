"""The server's metrics in the Prometheus text format (``GET /metrics``).

Names (prefix ``ditscale_serve_``):

- ``requests_total{endpoint, status}``: answered HTTP requests, by endpoint and status code
- ``jobs_total{status}``: finished jobs (succeeded / failed / cancelled)
- ``queue_depth``: queued jobs; ``running_jobs``: jobs of the batch that runs now
- ``job_latency_seconds``: histogram of a succeeded job's time from submission to its result
- ``run_seconds``: histogram of a batch's pipeline call on the group
- ``steps_total``: denoising steps run; ``steps_per_second``: of the last batch
- ``samples_total``: images / videos made
- ``gpu_memory_bytes{rank, kind}``: per rank after the last batch: ``allocated``, ``reserved``
  and ``peak`` (the batch's peak allocation; reset before each batch)
"""

from __future__ import annotations

import bisect
import threading
from typing import Dict, Iterable, List, Tuple

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PREFIX = "ditscale_serve_"


def _labels(pairs: Tuple[Tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), "")}"'
                     for k, v in pairs)
    return "{" + inner + "}"


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.bounds: List[float] = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> List[str]:
        out, total = [], 0
        for bound, count in zip(self.bounds, self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {total}')
        total += self.counts[-1]
        out.append(f'{name}_bucket{{le="+Inf"}} {total}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {total}")
        return out


class Metrics:
    """Thread-safe counters, gauges and histograms of the server."""

    HELP = {
        "requests_total": ("counter", "HTTP requests answered, by endpoint and status code"),
        "jobs_total": ("counter", "finished jobs by final status"),
        "queue_depth": ("gauge", "jobs waiting in the queue"),
        "running_jobs": ("gauge", "jobs of the batch running now"),
        "job_latency_seconds": ("histogram", "submission to result of succeeded jobs"),
        "run_seconds": ("histogram", "the pipeline call of a batch on the rank group"),
        "steps_total": ("counter", "denoising steps run"),
        "steps_per_second": ("gauge", "denoising steps per second of the last batch"),
        "samples_total": ("counter", "images or videos made"),
        "gpu_memory_bytes": ("gauge", "device memory per rank after the last batch"),
    }

    def __init__(self):
        self.lock = threading.Lock()
        self.counters: Dict[str, Dict[tuple, float]] = {}
        self.gauges: Dict[str, Dict[tuple, float]] = {}
        self.hists = {"job_latency_seconds": Histogram(LATENCY_BUCKETS),
                      "run_seconds": Histogram(LATENCY_BUCKETS)}

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        with self.lock:
            series = self.counters.setdefault(name, {})
            key = tuple(sorted(labels.items()))
            series[key] = series.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels) -> None:
        with self.lock:
            self.gauges.setdefault(name, {})[tuple(sorted(labels.items()))] = float(value)

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.hists[name].observe(value)

    def render(self) -> str:
        lines: List[str] = []
        with self.lock:
            for name, (kind, text) in self.HELP.items():
                full = PREFIX + name
                lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}"]
                if kind == "histogram":
                    lines += self.hists[name].lines(full)
                    continue
                series = (self.counters if kind == "counter" else self.gauges).get(name, {})
                if not series and kind == "gauge" and name != "gpu_memory_bytes":
                    lines.append(f"{full} 0")  # an unlabelled gauge not set yet
                for labels, value in sorted(series.items()):
                    lines.append(f"{full}{_labels(labels)} {value:g}")
        return "\n".join(lines) + "\n"
