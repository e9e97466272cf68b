// The AdaLN launch plans (internal/adaln_plan.h) pinned for the benchmark shapes
// (bench/adaln: bf16, LayerNorm, per-sample modulation as chunks of a [B, 6, D] tensor, no affine)
// and the other layouts the models use: a change of plan is a change of speed, so it must show
// here first. The expected plans are the measured winners of lab/adaln-kernel-notes.md
// (e.g. v13: D = 2560 5 x 64, 3840 5 x 96, 6144 3 x 256, 7680 5 x 192 in the bulk-copy forward;
// v9: 3 x 128 at D = 3072 in the backward). Host arithmetic only: the pointers are never read.
#include "ditscale/kernels/internal/adaln_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace ditscale::kernels::internal {
namespace {

const void* at(std::uintptr_t offset) { return reinterpret_cast<const void*>(0x100000 + offset); }
void* at_mut(std::uintptr_t offset) { return reinterpret_cast<void*>(0x100000 + offset); }

struct Layout {
  std::int64_t B = 2, N = 4096, D = 1536;
  DType dtype = DType::kBFloat16;
  DType mod_dtype = DType::kBFloat16;  // scale / shift / gate
  bool per_token = false;              // chunks of [B, N, 6D] instead of [B, 6, D]
  bool gated = false;
  bool affine = false;
  std::uintptr_t misalign = 0;  // bytes added to x's pointer
};

// A modulation row of the packed tensor (row k of 6).
RowsView mod_view(const Layout& l, int k) {
  const std::int64_t es = static_cast<std::int64_t>(dtype_size(l.mod_dtype));
  RowsView v;
  v.dtype = l.mod_dtype;
  v.data = at((1u << 28) + static_cast<std::uintptr_t>(k * l.D * es));
  v.stride_b = l.per_token ? l.N * 6 * l.D : 6 * l.D;
  v.stride_n = l.per_token ? 6 * l.D : 0;
  return v;
}

RowsView rows_view(const Layout& l, std::uintptr_t offset) {
  RowsView v;
  v.dtype = l.dtype;
  v.data = at(offset);
  v.stride_b = l.N * l.D;
  v.stride_n = l.D;
  return v;
}

void fill_config(const Layout& l, AdaLNConfig& p) {
  p.batch = l.B;
  p.seq_len = l.N;
  p.dim = l.D;
  p.dtype = l.dtype;
  p.scale = mod_view(l, 1);
  p.shift = mod_view(l, 0);
  if (l.gated) p.gate = mod_view(l, 2);
  if (l.affine) {
    p.weight = at(1u << 29);
    p.bias = at((1u << 29) + (1u << 20));
  }
}

std::string fwd(const Layout& l, bool tma = true, AdaLNTuning tune = {}) {
  AdaLNFwdParams p;
  fill_config(l, p);
  if (l.gated) {
    p.residual = rows_view(l, l.misalign);
    p.branch = rows_view(l, 1u << 30);
    p.h = at_mut(3u << 30);
  } else {
    p.x = rows_view(l, l.misalign);
  }
  p.y = at_mut(2u << 30);
  return describe(choose_fwd_plan(p, tma, tune));
}

std::string bwd(const Layout& l, AdaLNTuning tune = {}) {
  AdaLNBwdParams p;
  fill_config(l, p);
  (l.gated ? p.residual : p.x) = rows_view(l, l.misalign);
  p.dy = rows_view(l, 1u << 30);
  p.dx = at_mut(2u << 30);
  p.dscale = at_mut(3u << 30);
  p.dshift = at_mut((3u << 30) + (1u << 24));
  if (l.gated) {
    p.branch = rows_view(l, 1u << 31);
    p.dbranch = at_mut((1u << 31) + (1u << 30));
    p.dgate = at_mut((3u << 30) + (2u << 24));
  }
  if (l.affine) {
    p.dweight = at_mut((3u << 30) + (3u << 24));
    p.dbias = at_mut((3u << 30) + (4u << 24));
  }
  return describe(choose_bwd_plan(p, tune));
}

Layout dim(std::int64_t d) {
  Layout l;
  l.D = d;
  return l;
}

TEST(AdaLNPlan, ForwardOfTheBenchmarkShapes) {
  // Rows of <= 256 vectors: the warp-per-row kernel, coefficients packed 2 vectors ahead.
  EXPECT_EQ(fwd(dim(1536)), "warp 6x32 ahead 2");
  EXPECT_EQ(fwd(dim(1024)), "warp 4x32 ahead 2");
  EXPECT_EQ(fwd(dim(2048)), "warp 8x32 ahead 2");
  // Wider rows on sm_90: the bulk-copy kernel (notes v11, v13).
  EXPECT_EQ(fwd(dim(3072)), "tma 3x128 s4 bulk");
  EXPECT_EQ(fwd(dim(5120)), "tma 5x128 s4 bulk");
  EXPECT_EQ(fwd(dim(2560)), "tma 5x64 s4 bulk");
  EXPECT_EQ(fwd(dim(3840)), "tma 5x96 s4 bulk");
  EXPECT_EQ(fwd(dim(4096)), "tma 4x128 s4 bulk");
  EXPECT_EQ(fwd(dim(6144)), "tma 3x256 s4 bulk");
  EXPECT_EQ(fwd(dim(7680)), "tma 5x192 s4 bulk");
  // Coefficients recomputed per row above 40 elements per thread (notes v13, last item).
  EXPECT_EQ(fwd(dim(4608)), "tma 6x96 s4 bulk reload");
  EXPECT_EQ(fwd(dim(8192)), "tma 8x128 s4 bulk reload");
  // The batch and the sequence length do not change the plan.
  for (std::int64_t b : {1, 2}) {
    for (std::int64_t n : {4096, 16384, 65536}) {
      Layout l = dim(3072);
      l.B = b;
      l.N = n;
      EXPECT_EQ(fwd(l), "tma 3x128 s4 bulk") << b << " x " << n;
    }
  }
}

TEST(AdaLNPlan, ForwardWithoutBulkCopiesOrPipelinedKernels) {
  // sm_80 (or fwd_kernel = 1): the cp.async kernel, one row per thread, a ring of 3.
  EXPECT_EQ(fwd(dim(3072), /*tma=*/false), "pipe 3x128 s3");
  EXPECT_EQ(fwd(dim(5120), false), "pipe 5x128 s3");
  AdaLNTuning cp_async;
  cp_async.fwd_kernel = 1;
  EXPECT_EQ(fwd(dim(1536), true, cp_async), "pipe 2x96 s3");
  EXPECT_EQ(fwd(dim(5120), true, cp_async), "pipe 5x128 s3");
  AdaLNTuning bulk;
  bulk.fwd_kernel = 2;  // the bulk-copy kernel also for rows the warp kernel would take
  EXPECT_EQ(fwd(dim(2048), true, bulk), "tma 2x128 s4 thread-stores");
  EXPECT_EQ(fwd(dim(1536), true, bulk), "tma 2x96 s4 thread-stores");
  // The first kernels.
  AdaLNTuning base;
  base.pipelined = false;
  EXPECT_EQ(fwd(dim(3072), true, base), "vec 3x128");
  EXPECT_EQ(fwd(dim(1536), true, base), "vec 2x96");
  EXPECT_EQ(fwd(dim(256), true, base), "vec 1x32 rows 4");
}

TEST(AdaLNPlan, ForwardOfOtherLayouts) {
  Layout gated = dim(3072);  // gated: always the cp.async kernel
  gated.gated = true;
  EXPECT_EQ(fwd(gated), "pipe 3x128 s3");
  gated.D = 1536;
  EXPECT_EQ(fwd(gated), "pipe 2x96 s3");
  gated.D = 5120;
  gated.affine = true;
  EXPECT_EQ(fwd(gated), "pipe 5x128 s3");
  Layout tok = dim(1536);  // per token in x's dtype: packed, all with the x loads
  tok.per_token = true;
  EXPECT_EQ(fwd(tok), "warp 6x32 ahead 6");
  tok.mod_dtype = DType::kFloat32;  // Wan 2.2: fp32 per-token modulation, at use
  EXPECT_EQ(fwd(tok), "warp 6x32 at-use prefetch hints");
  Layout affine = dim(1536);
  affine.affine = true;
  EXPECT_EQ(fwd(affine), "warp 6x32 at-use prefetch hints");
  affine.dtype = affine.mod_dtype = DType::kFloat16;  // prefetch: bf16 only
  EXPECT_EQ(fwd(affine), "warp 6x32 at-use hints");
  Layout f32 = dim(1024);  // fp32: 4 elements per vector; fp32 modulation is loaded at use
  f32.dtype = f32.mod_dtype = DType::kFloat32;
  EXPECT_EQ(fwd(f32), "warp 8x32 at-use hints");
  f32.D = 2048;
  EXPECT_EQ(fwd(f32), "tma 4x128 s4 bulk");
  Layout half = dim(6144);  // fp16 has no bf16 preference: 6 vectors, coefficients per row
  half.dtype = half.mod_dtype = DType::kFloat16;
  EXPECT_EQ(fwd(half), "tma 6x128 s4 bulk reload");
  // No vector plan fits: D not a multiple of the vector, a misaligned x, very wide rows.
  EXPECT_EQ(fwd(dim(1001)), "general");
  Layout odd = dim(1536);
  odd.misalign = 2;
  EXPECT_EQ(fwd(odd), "general");
  Layout wide = dim(20000);
  wide.affine = true;
  EXPECT_EQ(fwd(wide), "general");
}

TEST(AdaLNPlan, BackwardOfTheBenchmarkShapes) {
  // Lean bf16: the pipelined kernel with the two-row ring; 64 threads per row up to 3 KB rows,
  // 128 above (notes v8, v9); the register-capped candidate at 4 vectors per thread (v13).
  EXPECT_EQ(bwd(dim(1536)), "pipe 3x64 s2 lean");
  EXPECT_EQ(bwd(dim(3072)), "pipe 3x128 s2 lean");
  EXPECT_EQ(bwd(dim(5120)), "pipe 4x160 s2 lean cap?");
  EXPECT_EQ(bwd(dim(4096)), "pipe 4x128 s2 lean cap?");
  EXPECT_EQ(bwd(dim(8192)), "pipe 4x256 s2 lean cap?");
  for (std::int64_t b : {1, 2}) {
    for (std::int64_t n : {4096, 16384, 65536}) {
      Layout l = dim(5120);
      l.B = b;
      l.N = n;
      EXPECT_EQ(bwd(l), "pipe 4x160 s2 lean cap?") << b << " x " << n;
    }
  }
}

TEST(AdaLNPlan, BackwardOfOtherLayouts) {
  Layout full = dim(3072);  // gated + affine, 16-bit: not lean, ring of 2, ~96 threads per row
  full.gated = true;
  full.affine = true;
  EXPECT_EQ(bwd(full), "pipe 4x96 s2");
  Layout wan = dim(1536);  // Wan 2.1 1.3B's gated ops: 2 vectors x 96 threads, ring of 2
  wan.gated = true;
  EXPECT_EQ(bwd(wan), "pipe 2x96 s2");
  Layout gated32 = wan;  // fp32 gated rows keep the ring of 3 and the target of 64 threads
  gated32.dtype = gated32.mod_dtype = DType::kFloat32;
  EXPECT_EQ(bwd(gated32), "pipe 4x96 s3");
  Layout f32 = dim(3072);
  f32.dtype = f32.mod_dtype = DType::kFloat32;
  EXPECT_EQ(bwd(f32), "pipe 4x192 s3 lean");
  AdaLNTuning base;
  base.pipelined = false;
  EXPECT_EQ(bwd(dim(3072), base), "vec 1x384");
  EXPECT_EQ(bwd(dim(1001)), "general");
  Layout wide = dim(20000);
  wide.affine = true;
  EXPECT_EQ(bwd(wide), "general");
}

}  // namespace
}  // namespace ditscale::kernels::internal
