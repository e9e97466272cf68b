// The AdaLN CUDA launchers' plan override for A/B runs and tests: an explicit argument of
// adaln_forward_cuda_tuned / adaln_backward_cuda_tuned (the public adaln_forward_cuda /
// adaln_backward_cuda use the defaults, the tuned choices). No process-wide state, no environment
// variable. Plain C++, no CUDA headers.
//
// Only the knobs that an A/B run or a test still needs are left: the search knobs of the
// kernel tuning (ring depths, rows per thread or per group, store and hint variants, vector and
// thread targets, register caps) were removed with the variants that lost; the plans they chose
// are fixed in choose_fwd_plan / choose_bwd_plan (adaln_plan.h) and the measurements are in
// lab/adaln-kernel-notes.md ("Removed variants").
#pragma once

namespace ditscale::kernels {
struct AdaLNFwdParams;
struct AdaLNBwdParams;
}  // namespace ditscale::kernels

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

// The tuning of the AdaLN launch in progress on this thread (what the launchers' helpers read):
// the override of the *_tuned call below, else the defaults AdaLNTuning{}. Read-only.
const AdaLNTuning& adaln_tuning();

// adaln_forward_cuda / adaln_backward_cuda (adaln.h) with the plan override `tuning` (for the
// kernel benchmark's variants and the GPU tests' small grids); `tuning` is read for the call only.
void adaln_forward_cuda_tuned(const AdaLNFwdParams& p, void* stream, const AdaLNTuning& tuning);
void adaln_backward_cuda_tuned(const AdaLNBwdParams& p, void* stream, const AdaLNTuning& tuning);

// Makes `tuning` this thread's adaln_tuning() for its lifetime (the *_tuned calls use it).
class ScopedAdaLNTuning {
 public:
  explicit ScopedAdaLNTuning(const AdaLNTuning& tuning);
  ~ScopedAdaLNTuning();
  ScopedAdaLNTuning(const ScopedAdaLNTuning&) = delete;
  ScopedAdaLNTuning& operator=(const ScopedAdaLNTuning&) = delete;

 private:
  const AdaLNTuning* previous_;
};

// Applies "name=value,name=value" to `t` (field names of AdaLNTuning, integer values:
// `pipelined` 0 or 1, `fwd_kernel` 0-3, `pdl` 0 or 1, `max_resident_blocks` >= 0; the kernel
// benchmark's --variants); an unknown name, a malformed value or one out of its range throws
// ditscale::Error naming `source` and the entry.
void apply_adaln_tuning(AdaLNTuning& t, const char* text, const char* source);

}  // namespace ditscale::kernels::internal
