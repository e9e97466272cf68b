// Process-wide knobs of the AdaLN CUDA launchers for A/B runs and tests. Defaults are the tuned
// choices; production code never changes them. Not thread-safe: set them before launching, from
// one thread. Plain C++, no CUDA headers.
//
// Only the knobs that an A/B run or a test still needs are left: the search knobs of the
// kernel tuning (ring depths, rows per thread or per group, store and hint variants, vector and
// thread targets, register caps) were removed with the variants that lost; the plans they chose
// are fixed in choose_fwd_plan / choose_bwd_plan (adaln_plan.h) and the measurements are in
// lab/adaln-kernel-notes.md ("Removed variants").
#pragma once

namespace ditscale::kernels::internal {

struct AdaLNTuning {
  // true: the pipelined kernels of the plan (adaln_plan.h); false: the first kernels (one row per
  // block forward, one block per tile backward), which stay as the fallbacks of rows whose rings
  // do not fit: the A/B baseline of every later kernel, and their test coverage at any D.
  bool pipelined = true;
  // Forward kernel of plain calls: 0 = automatic (the warp-per-row kernel for rows of <= 256
  // 16-byte vectors, else the bulk-copy kernel where the build has sm_90 code for the device and
  // the row has >= 64 vectors, else the cp.async kernel; gated calls always take the cp.async
  // one); 1 = the cp.async kernel (the default of sm_80 devices: A/B and tests on an H200);
  // 2 = the bulk-copy kernel where it applies, else as 1; 3 = as 0.
  int fwd_kernel = 0;
  // Programmatic dependent launch of every AdaLN kernel on sm_90+ (1 on, 0 off): each kernel may
  // be scheduled during the previous kernel's tail and waits for its results (adaln_launch.h).
  int pdl = 1;
  // Upper bound on the grid of the persistent kernels (0 = one wave of resident blocks, from the
  // occupancy calculator). Tests set it small so that every block walks many rows, wraps its ring
  // and crosses sample boundaries.
  int max_resident_blocks = 0;
};

// The process-wide knobs (defined in adaln_tuning.cc). Their first use reads the environment
// variable DITSCALE_ADALN_TUNING, e.g. "pdl=0,fwd_kernel=1" (field names of AdaLNTuning, integer
// values: `pipelined` 0 or 1, `fwd_kernel` 0-3, `pdl` 0 or 1, `max_resident_blocks` >= 0), so that
// a Python benchmark can compare variants one process each; an unknown name, a malformed value or
// one out of its range throws ditscale::Error naming the variable and the entry.
AdaLNTuning& adaln_tuning();

// Applies "name=value,name=value" to `t` (the parser behind DITSCALE_ADALN_TUNING; `source` names
// the text's origin in errors).
void apply_adaln_tuning(AdaLNTuning& t, const char* text, const char* source);

}  // namespace ditscale::kernels::internal
