"""Fused AdaLN benchmarks: bench_adaln (timings vs eager and torch.compile), profile_adaln."""
