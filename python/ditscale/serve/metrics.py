"""The server's metrics (``GET /metrics``) through ``prometheus_client``, one registry a server.

Names (prefix ``ditscale_serve_``), declared in :data:`SPECS`:

- ``requests_total{endpoint, status}``: answered HTTP requests (ids in paths as ``{id}``)
- ``jobs_total{status}``, ``samples_total``, ``steps_total``: finished jobs, images / videos
  made, denoising steps run; ``queue_depth``, ``running_jobs``, ``steps_per_second``
- ``job_latency_seconds``, ``run_seconds``: a succeeded job's submission to result; a batch's
  pipeline calls on the group
- ``stage_seconds{stage}``: per stage (``text_encoding``, ``denoising_step``, ``vae_decode``,
  ``output_encoding``; docs/serve.md)
- ``gpu_memory_bytes{rank, kind}``: per rank after the last batch (allocated, reserved, peak)
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

PREFIX = "ditscale_serve_"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 300.0)
STAGES = ("text_encoding", "denoising_step", "vae_decode", "output_encoding")
CONTENT_TYPE = CONTENT_TYPE_LATEST

# name -> (kind, help, labels, buckets); counters' names are given without "_total"
SPECS = {
    "requests": (Counter, "HTTP requests answered, by endpoint and status code",
                 ("endpoint", "status"), None),
    "jobs": (Counter, "finished jobs by final status", ("status",), None),
    "queue_depth": (Gauge, "jobs waiting in the queue", (), None),
    "running_jobs": (Gauge, "jobs of the batch running now", (), None),
    "job_latency_seconds": (Histogram, "submission to result of succeeded jobs", (),
                            LATENCY_BUCKETS),
    "run_seconds": (Histogram, "the pipeline calls of a batch on the rank group", (),
                    LATENCY_BUCKETS),
    "stage_seconds": (Histogram, "a pipeline stage's seconds (rank 0; a denoising step each)",
                      ("stage",), STAGE_BUCKETS),
    "steps": (Counter, "denoising steps run", (), None),
    "steps_per_second": (Gauge, "denoising steps per second of the last batch", (), None),
    "samples": (Counter, "images or videos made", (), None),
    "gpu_memory_bytes": (Gauge, "device memory per rank after the last batch",
                         ("rank", "kind"), None),
}


class Metrics:
    """The metrics of :data:`SPECS` as attributes (``metrics.jobs.labels(status=...)``), in a
    registry of their own (several servers in one process do not collide)."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        for name, (kind, text, labels, buckets) in SPECS.items():
            kw = {"buckets": buckets} if buckets else {}
            setattr(self, name, kind(PREFIX + name, text, labels, registry=self.registry, **kw))

    def render(self) -> bytes:
        return generate_latest(self.registry)
