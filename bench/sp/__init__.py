"""SwiftFusion (sequence-parallel attention) benchmarks: bench_sp_attention, calibrate, fit_runs,
report, replay_compute, peers."""
