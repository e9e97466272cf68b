"""Benchmarks of ``python -m ditscale.serve``: ``bench_serve`` (the server against the pipeline
called directly)."""
