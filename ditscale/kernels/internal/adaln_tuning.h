// Process-wide tuning knobs of the AdaLN CUDA launchers, for benchmarks and A/B measurements
// (bench/adaln_kernel_bench.cu). Defaults are the tuned choices; production code never changes
// them. Not thread-safe: set them before launching, from one thread. Plain C++, no CUDA headers.
#pragma once

namespace ditscale::kernels::internal {

struct AdaLNTuning {
  // true: the pipelined persistent kernels (cp.async ring, modulation cached in registers);
  // false: the first, one-row-per-block / one-block-per-tile kernels (kept for comparison).
  bool pipelined = true;
  // Depth of the cp.async ring in rows (2, 3 or 4; kStages - 1 rows are in flight ahead of the
  // one being processed). Values other than 3 are instantiated for bf16 only (the backward: lean
  // bf16 calls, i.e. no affine, no gate); other calls use 3. Backward 2: one row ahead measured
  // +1 to +16 points of the copy bandwidth over 3 with the folded arithmetic of
  // adaln-kernel-notes.md v9.
  int fwd_stages = 3;
  int bwd_stages = 2;
  // Rows each forward thread carries per iteration: 0 = automatic (2 when the registers allow),
  // 1 or 2.
  int fwd_rows = 0;
  // Threads per row the vector plans aim for (ties between equally padded plans).
  int fwd_target_tpr = 128;
  // Forward kernel: 0 = automatic (plain calls: the warp-per-row kernel of adaln_fwd_warp.cuh for
  // rows of <= 256 16-byte vectors, else the bulk-copy kernel of adaln_fwd_tma.cuh where the
  // build has sm_90 code for the device and the row has >= 64 vectors; otherwise, and for gated
  // calls, the cp.async kernel), 1 = the cp.async kernel, 2 = the bulk-copy kernel where it
  // applies (else the cp.async one), 3 = the warp-per-row kernel where it applies (else as 2).
  int fwd_kernel = 0;
  // Warp-per-row kernel: rows per warp (1 or 2; 0 = automatic = 1; 2 is instantiated for bf16
  // only, other dtypes take 1; packed coefficients take 1).
  int fwd_warp_rows = 0;
  // Warp-per-row kernel: persistent grid with the next row group's loads issued before the
  // current one is reduced (register double buffer; instantiated for bf16, other dtypes ignore
  // it): 1 on, 0 off, -1 automatic (on with coefficients loaded at use, where it measured +0-1.5
  // points of the copy bandwidth at D = 1024-1536; off with packed coefficients, which do not
  // prefetch: a grid of all rows, one per warp, measured fastest there). In bf16, 1 here or
  // fwd_warp_rows = 2 selects coefficients at use.
  int fwd_warp_prefetch = -1;
  // Warp-per-row kernel: scale/shift loaded packed ahead of use (-1 automatic: where it applies,
  // i.e. modulation in x's dtype and no affine; 0: at use, as each vector is written). Measured
  // at D = 1536 in bench/adaln_probe: 72-80% -> ~89-95% of the copy bandwidth
  // (adaln-kernel-notes.md v6).
  int fwd_coef_ahead = -1;
  // Streaming cache hints on the forward's x loads and y stores: 1 on, 0 off, -1 automatic (on
  // for the warp-per-row kernel with coefficients at use: ld.global.cs / st.global.cs measured
  // +1-3.5 points at D = 1024-1536 there; never with packed coefficients, where they cost 1-6
  // points; off for the bulk-copy kernel, whose L2 evict-first hints gained nothing).
  int fwd_evict_first = -1;
  // Bulk-copy kernel: ring depth in rows (3, 4 or 6; other values than 4 and per-thread stores
  // are instantiated for bf16 with 2, 3 or 5 vectors per thread only, others use 4 + bulk
  // stores); y through bulk stores (1), per-thread 16-byte stores (0) or automatic (-1: bulk
  // stores for rows above 4 KB; measured: 3 KB rows 1-2.5 points faster with per-thread stores,
  // 6 and 10 KB rows 2-20 points faster with bulk stores); L2 evict-first hints
  // (fwd_evict_first); coefficients recomputed per row (1), kept in registers (0) or automatic (-1:
  // per row only when a thread holds more than 40 elements; at 40, D = 5120 bf16, registers
  // measured 91.6% of copy against 79.9% per row). fwd_tma_stages 0 = automatic: 4, or 6 for groups
  // of several rows (fewer blocks per SM with bigger blocks: the deeper ring keeps as many bytes in
  // flight).
  int fwd_tma_stages = 0;
  int fwd_bulk_store = -1;
  int fwd_coef_reload = -1;
  // Bulk-copy kernel: consecutive rows per block iteration (1, 2 or 4, applied to rows of <= 3
  // vectors per thread with coefficients in registers and tpr >= 64; 0 = automatic = 1: groups
  // measured slower, see adaln-kernel-notes.md v4). Groups above 4 KB take bulk stores.
  int fwd_tma_rows = 0;
  // Bulk-copy kernel, bf16: among the vector plans that pad a row least, 1 = prefer 5 vectors
  // per thread, then 3 vectors where the row's threads are whole 4-warp groups; 0 = none (then
  // fwd_target_tpr decides). Measured (kernel bench, [1, 65536, D], % of the copy bandwidth,
  // adaln-kernel-notes.md v13), preferred / previous plan: D = 2560 5 x 64 threads 100 / 81
  // (2 x 160), 3840 5 x 96 93 / 84 (3 x 160), 6144 3 x 256 89 / 62 (6 x 128, coefficients
  // reloaded per row), 7680 5 x 192 87 / 78 (6 x 160); 3 x 192 at D = 4608 measured 72 against
  // 81 for 6 x 96, and 3 x 320 at 7680 58: hence whole 4-warp groups. D = 3072 / 5120 unchanged.
  int fwd_tma_prefer = 1;
  // Bulk-copy kernel: vectors per thread forced (1-6 or 8; 0 = the plan choice above), for A/B
  // runs; a row that does not fit that many takes the next kernel.
  int fwd_tma_vecs = 0;
  // Pipelined backward: threads per row the vector plan aims for (ties between equally padded
  // plans); 0 = automatic: 128 for lean 16-bit rows of more than 192 16-byte vectors (3 KB), 64
  // otherwise. Measured
  // (adaln-kernel-notes.md v8, v9): 64 against 128 +3 to +15 points of the copy bandwidth at
  // D = 1024-1536 (bf16); with the folded arithmetic 128 against 64 +5 to +6 points at D = 3072
  // (3 vectors x 128 threads instead of 4 x 96); D = 5120 has one plan either way.
  int bwd_target_tpr = 0;
  // Pipelined backward, lean bf16 with the two-row ring: 128 = the instantiation whose launch
  // bound caps the registers at 128 per thread, so that more blocks fit per SM (its block may
  // then have up to 512 threads in the vector plan); 0 = never; -1 = automatic: at 4 vectors per
  // thread where the uncapped kernel fits at most 2 blocks per SM and the capped one more
  // (D = 5120 / 8192 bf16; adaln_bwd.cu).
  int bwd_reg_cap = -1;
  // Programmatic dependent launch of every AdaLN kernel on sm_90+ (1 on, 0 off): each kernel may
  // be scheduled during the previous kernel's tail and waits for its results (adaln_launch.h).
  int pdl = 1;
  // Upper bound on resident blocks per SM used to size the persistent grids (0 = the occupancy
  // calculator's value).
  int max_blocks_per_sm = 0;
  // Upper bound on the whole persistent grid (0 = none). Tests set it small so that every block
  // walks many rows, wraps its ring and crosses sample boundaries.
  int max_resident_blocks = 0;
};

// The process-wide knobs (defined in adaln.cu). Their first use reads the environment variable
// DITSCALE_ADALN_TUNING, e.g. "pdl=0,bwd_stages=3" (field names of AdaLNTuning, integer values;
// `pipelined` takes 0 / 1), so that a Python benchmark can compare variants one process each;
// an unknown name or a malformed value throws ditscale::Error naming the variable and the entry.
AdaLNTuning& adaln_tuning();

// Applies "name=value,name=value" to `t` (the parser behind DITSCALE_ADALN_TUNING; `source` names
// the text's origin in errors).
void apply_adaln_tuning(AdaLNTuning& t, const char* text, const char* source);

}  // namespace ditscale::kernels::internal
