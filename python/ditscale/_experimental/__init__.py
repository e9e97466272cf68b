"""Experiments, not the library's API: knobs and modes that benchmarks and diagnostics use to
compare variants, kept out of ditscale.sp.Config and ditscale.ops. They may change or go without
notice; code outside bench/, lab/ and the GPU tests should not use them. docs/sp.md
("Experiments") lists them.

Modules (import them by name; nothing is imported here):

- ``sp_variants``: the GPU runtime's engine and signal variants and NCCL channels per peer
  (``Variant``; environment variables DITSCALE_SP_ONE_SIDED_ENGINE, DITSCALE_SP_CE_SIGNAL,
  DITSCALE_SP_NET_CHANNELS_PER_PEER).
- ``sp_local``: ``run_local`` (every rank of a one-sided schedule in one process) and
  ``replay_compute`` (one rank's compute with its transfers skipped).
"""
