"""Training from real media: a generated corpus, ``ditscale.prepare`` throughput, and
``ditscale.train`` from the store against in-memory data (``bench_train.py``; bench/README.md)."""
