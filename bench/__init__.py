"""ditscale's benchmark suite as one package, run from the repository root (bench/README.md):

    python -m bench.sp.report ...        torchrun --nproc-per-node 2 -m bench.sp.calibrate ...
    python -m bench.adaln.bench_adaln    python -m bench.diffusers.adaln_models ...

bench.timing is the one timer and bench.reporter the one reporter (a header: device, commit,
command, date; then a table) of every benchmark; bench.common holds what several scripts share
(the ditscale CLI, Flux's attention-call inputs). Experiments live in lab/, not here."""
