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
  // one being processed). Values other than 3 are instantiated for bf16 only; other dtypes use 3.
  int fwd_stages = 3;
  int bwd_stages = 3;
  // Rows each forward thread carries per iteration: 0 = automatic (2 when the registers allow),
  // 1 or 2.
  int fwd_rows = 0;
  // Threads per row the vector plans aim for (ties between equally padded plans).
  int fwd_target_tpr = 128;
  int bwd_target_tpr = 128;
  // Upper bound on resident blocks per SM used to size the persistent grids (0 = the occupancy
  // calculator's value).
  int max_blocks_per_sm = 0;
  // Upper bound on the whole persistent grid (0 = none). Tests set it small so that every block
  // walks many rows, wraps its ring and crosses sample boundaries.
  int max_resident_blocks = 0;
};

// The process-wide knobs (defined in adaln.cu).
AdaLNTuning& adaln_tuning();

}  // namespace ditscale::kernels::internal
