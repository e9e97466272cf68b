// Fused AdaLN forward: one read of x (or residual + gate * branch), one write of y (and h), fp32
// statistics kept in registers. See adaln.h for the math and layouts.
//
// Default: plain (not gated) calls with rows of <= 256 16-byte vectors take the warp-per-row
// kernel of internal/adaln_fwd_warp.cuh (row in registers, shuffles only); wider plain rows, on
// sm_90 builds and devices, the bulk-copy kernel of internal/adaln_fwd_tma.cuh (whole-row bulk
// loads and stores through a shared-memory ring); otherwise the pipelined persistent kernel of
// internal/adaln_fwd_pipe.cuh (cp.async ring, modulation in registers). The vector kernel below is
// the first version, used when the ring would not fit or AdaLNTuning::pipelined is off. Vector
// kernel (D % V == 0 and 16-byte aligned views, V = 16 bytes / sizeof(T)): a row is held in
// registers by `tpr` threads (blockDim.x, a multiple of 32), each owning kVecs vectors of V
// elements (vector i of thread t is feature vector j * tpr + t: consecutive threads read
// consecutive 16-byte chunks). blockDim.y rows share a block when a row takes one warp. Mean,
// then the centred variance from the registers (two-pass, stable); warp shuffle, then the row's
// warps through shared memory. General kernel: a block of 256 threads per row re-reading the row
// (L1/L2 hits) in three passes; any D and any alignment.
#include <cuda_runtime.h>

#include <algorithm>
#include <iterator>
#include <type_traits>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_fwd_pipe.cuh"
#include "ditscale/kernels/internal/adaln_fwd_tma.cuh"
#include "ditscale/kernels/internal/adaln_fwd_warp.cuh"
#include "ditscale/kernels/internal/adaln_launch.h"
#include "ditscale/kernels/internal/adaln_tuning.h"
#include "ditscale/kernels/internal/dispatch.h"

namespace ditscale::kernels {
namespace internal {
namespace {

// Register budget: elements held per thread -> the largest block we allow (so that
// __launch_bounds__ leaves 64 / 128 / 255 registers (ptxas: no spills) per thread).
constexpr int fwd_max_threads(int elems_per_thread) {
  return elems_per_thread <= 8 ? 1024 : (elems_per_thread <= 24 ? 512 : 256);
}

template <typename T, int kVecs>
__global__ void __launch_bounds__(fwd_max_threads(kVecs * 16 / sizeof(T)), 1)
    adaln_fwd_vec_kernel(const FwdArgs a) {
  pdl_enter();  // before any global access (adaln_device.cuh)
  constexpr int V = 16 / sizeof(T);
  __shared__ float red[2][32];
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool row_ok = row < a.rows;
  const std::int64_t b = row_ok ? row / a.n : 0;
  const std::int64_t n = row_ok ? row - b * a.n : 0;
  const int nvec = static_cast<int>(a.d / V);
  const float inv_d = 1.0f / static_cast<float>(a.d);

  float v[kVecs][V];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = j * blockDim.x + threadIdx.x;
    const std::int64_t d = static_cast<std::int64_t>(vi) * V;
    if (row_ok && vi < nvec) {
      if (a.gated) {
        float r[V], g[V], br[V];
        load_vec<V>(static_cast<const T*>(a.x.data) + view_offset(a.x, b, n, d), r);
        load_view_vec<V, T>(a.gate, view_offset(a.gate, b, n, d), g);
        load_vec<V>(static_cast<const T*>(a.branch.data) + view_offset(a.branch, b, n, d), br);
#pragma unroll
        for (int e = 0; e < V; ++e) v[j][e] = round_to<T>(fmaf(g[e], br[e], r[e]));
        store_vec<V>(static_cast<T*>(a.h) + row * a.d + d, v[j]);
      } else {
        load_vec<V>(static_cast<const T*>(a.x.data) + view_offset(a.x, b, n, d), v[j]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) v[j][e] = 0.f;
    }
  }

  float mean = 0.f;
  if (!a.rms) {
    float s[1] = {0.f};
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
#pragma unroll
      for (int e = 0; e < V; ++e) s[0] += v[j][e];
    }
    row_sum<1>(s, red[0]);
    mean = s[0] * inv_d;
  }
  float q[1] = {0.f};
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (static_cast<int>(j * blockDim.x + threadIdx.x) < nvec) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float c = v[j][e] - mean;
        q[0] = fmaf(c, c, q[0]);
      }
    }
  }
  row_sum<1>(q, red[1]);
  const float rstd = rsqrtf(q[0] * inv_d + a.eps);
  if (row_ok && threadIdx.x == 0 && a.mean != nullptr) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  if (!row_ok) return;  // no barrier below

#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = j * blockDim.x + threadIdx.x;
    if (vi >= nvec) continue;
    const std::int64_t d = static_cast<std::int64_t>(vi) * V;
    float sc[V], sh[V], w[V], bi[V];
    load_view_vec<V, T>(a.scale, view_offset(a.scale, b, n, d), sc);
    load_view_vec<V, T>(a.shift, view_offset(a.shift, b, n, d), sh);
    if (a.weight != nullptr) {
      load_view_vec<V, T>(DevView{a.weight, 0, 0, a.affine_f32}, d, w);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) w[e] = 1.f;
    }
    if (a.bias != nullptr) {
      load_view_vec<V, T>(DevView{a.bias, 0, 0, a.affine_f32}, d, bi);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) bi[e] = 0.f;
    }
    float y[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float xn = fmaf((v[j][e] - mean) * rstd, w[e], bi[e]);
      y[e] = fmaf(xn, 1.f + sc[e], sh[e]);
    }
    store_vec<V>(static_cast<T*>(a.y) + row * a.d + d, y);
  }
}

constexpr int kGeneralThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kGeneralThreads) adaln_fwd_general_kernel(const FwdArgs a) {
  pdl_enter();  // before any global access (adaln_device.cuh)
  __shared__ float red[2][32];
  const std::int64_t row = blockIdx.x;
  const std::int64_t b = row / a.n;
  const std::int64_t n = row - b * a.n;
  const float inv_d = 1.0f / static_cast<float>(a.d);
  T* h = static_cast<T*>(a.h) + row * a.d;
  // Input element d of the norm; the gated variant computes and stores h in the first pass and
  // re-reads its own writes later (same thread, same d).
  auto input = [&](std::int64_t d) {
    if (a.gated) return to_f(h[d]);
    return to_f(static_cast<const T*>(a.x.data)[view_offset(a.x, b, n, d)]);
  };
  float s[1] = {0.f};
  for (std::int64_t d = threadIdx.x; d < a.d; d += blockDim.x) {
    float val;
    if (a.gated) {
      const float r = to_f(static_cast<const T*>(a.x.data)[view_offset(a.x, b, n, d)]);
      const float g = load_any<T>(a.gate.data, a.gate.f32, view_offset(a.gate, b, n, d));
      const float br = to_f(static_cast<const T*>(a.branch.data)[view_offset(a.branch, b, n, d)]);
      const T ht = from_f<T>(fmaf(g, br, r));
      h[d] = ht;
      val = to_f(ht);
    } else {
      val = input(d);
    }
    s[0] += val;
  }
  float mean = 0.f;
  if (!a.rms) {
    row_sum<1>(s, red[0]);
    mean = s[0] * inv_d;
  }
  float q[1] = {0.f};
  for (std::int64_t d = threadIdx.x; d < a.d; d += blockDim.x) {
    const float c = input(d) - mean;
    q[0] = fmaf(c, c, q[0]);
  }
  row_sum<1>(q, red[1]);
  const float rstd = rsqrtf(q[0] * inv_d + a.eps);
  if (threadIdx.x == 0 && a.mean != nullptr) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  T* y = static_cast<T*>(a.y) + row * a.d;
  for (std::int64_t d = threadIdx.x; d < a.d; d += blockDim.x) {
    const float w = a.weight != nullptr ? load_any<T>(a.weight, a.affine_f32, d) : 1.f;
    const float bi = a.bias != nullptr ? load_any<T>(a.bias, a.affine_f32, d) : 0.f;
    const float sc = load_any<T>(a.scale.data, a.scale.f32, view_offset(a.scale, b, n, d));
    const float sh = load_any<T>(a.shift.data, a.shift.f32, view_offset(a.shift, b, n, d));
    const float xn = fmaf((input(d) - mean) * rstd, w, bi);
    y[d] = from_f<T>(fmaf(xn, 1.f + sc, sh));
  }
}

constexpr int kFwdVecCandidates[] = {1, 2, 3, 4, 5, 6, 8};
// Rings above this take the first vector kernel (several blocks per SM must fit in 227 KB).
constexpr std::size_t kMaxFwdRingBytes = 112 * 1024;

// Launches the pipelined kernel with a grid of (resident blocks per SM) x SMs, capped by the work.
template <typename T, int kVecs, int kStages, int kRows>
void launch_fwd_pipe(const FwdArgs& a, const VecPlan& plan, int rows_per_group,
                     cudaStream_t stream) {
  auto* kernel = adaln_fwd_pipe_kernel<T, kVecs, kStages, kRows>;
  const int streams = a.gated ? 2 : 1;
  const std::size_t smem = static_cast<std::size_t>(kStages) * kRows * streams * rows_per_group *
                           plan.threads * kVecs * 16;
  const int threads = plan.threads * rows_per_group;
  const std::int64_t groups = (a.rows + rows_per_group - 1) / rows_per_group;
  const std::int64_t items = (groups + kRows - 1) / kRows;
  const std::int64_t grid = persistent_grid(kernel, threads, smem, items);
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(plan.threads, rows_per_group), smem,
                stream, a, items);
}

// Launches the bulk-copy kernel (kRows rows per block iteration, persistent grid). Returns false,
// launching nothing, when the build holds no sm_90 code for the current device.
template <typename T, int kVecs, int kStages, bool kBulkStore, bool kCoefReload, int kRows>
bool launch_fwd_tma(const FwdArgs& a, int tpr, cudaStream_t stream) {
  auto* kernel = adaln_fwd_tma_kernel<T, kVecs, kStages, kBulkStore, kCoefReload, kRows>;
  cudaFuncAttributes attr{};
  DS_CHECK_CUDA(cudaFuncGetAttributes(&attr, kernel));
  if (attr.binaryVersion < 90) return false;
  const std::size_t smem =
      static_cast<std::size_t>(kStages) * kRows * static_cast<std::size_t>(a.d) * sizeof(T);
  const std::int64_t groups = (a.rows + kRows - 1) / kRows;
  const std::int64_t grid = persistent_grid(kernel, tpr * kRows, smem, groups);
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(tpr, kRows), smem, stream, a);
  return true;
}

// The warp-per-row forward for aligned, plain calls with rows < 2^31 (checked by the caller) of
// at most kFwdWarpMaxVecs * 32 vectors; false when it does not apply or is not selected.
bool try_fwd_warp(const AdaLNFwdParams& p, FwdArgs a, int vec, cudaStream_t stream) {
  const AdaLNTuning& tune = adaln_tuning();
  if ((tune.fwd_kernel != 0 && tune.fwd_kernel != 3) || a.gated) return false;
  const std::int64_t nvec = p.dim / vec;
  const int vecs = static_cast<int>((nvec + 31) / 32);
  if (vecs < 1 || vecs > kFwdWarpMaxVecs) return false;
  // Packed coefficients (adaln_fwd_warp.cuh): scale and shift in x's dtype, no affine; 2 vectors
  // ahead for modulation per sample, all of the row's with its x loads per token.
  // Asking for prefetch or two rows per warp (bf16) selects the form with coefficients at use.
  const bool bf16 = p.dtype == DType::kBFloat16;
  const bool packable = !a.scale.f32 && !a.shift.f32 && a.weight == nullptr && a.bias == nullptr;
  const bool packed = packable && tune.fwd_coef_ahead != 0 &&
                      !(bf16 && (tune.fwd_warp_prefetch > 0 || tune.fwd_warp_rows == 2));
  const bool per_token = a.scale.sn != 0 || a.shift.sn != 0;
  // Rows per warp, prefetch, streaming hints: automatic = one row, no prefetch and no hints with
  // packed coefficients (bench/results/adaln-kernel-notes.md v6), else prefetch and hints (v5).
  const int rows = tune.fwd_warp_rows == 2 && bf16 && !packed ? 2 : 1;
  const bool prefetch = tune.fwd_warp_prefetch != 0 && bf16 && !packed;
  a.evict_first = tune.fwd_evict_first < 0 ? !packed : tune.fwd_evict_first != 0;  // packed: none
  const std::int64_t warps = (a.rows + rows - 1) / rows;
  const std::int64_t blocks = (warps + kFwdWarpsPerBlock - 1) / kFwdWarpsPerBlock;
  const dim3 block(32, kFwdWarpsPerBlock);
  auto launch = [&](auto* kernel) {
    std::int64_t grid = blocks;
    if (packed) {  // (token blocks, samples): adaln_fwd_warp.cuh
      std::int64_t gx = (p.seq_len + kFwdWarpsPerBlock - 1) / kFwdWarpsPerBlock;
      const std::int64_t gy = std::min<std::int64_t>(p.batch, 65535);
      if (tune.max_resident_blocks > 0) {
        gx = std::max<std::int64_t>(1, std::min<std::int64_t>(gx, tune.max_resident_blocks / gy));
      }
      DS_CHECK(gx >= 1 && gx <= 0x7fffffff, "AdaLN: invalid grid size ", gx);
      launch_kernel(kernel, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), block, 0,
                    stream, a);
      return;
    }
    if (prefetch) {
      grid = persistent_grid(kernel, 32 * kFwdWarpsPerBlock, 0, blocks);
    } else if (tune.max_resident_blocks > 0) {
      grid = std::min<std::int64_t>(grid, tune.max_resident_blocks);
    }
    DS_CHECK(grid >= 1 && grid <= 0x7fffffff, "AdaLN: invalid grid size ", grid);
    launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), block, 0, stream, a);
  };
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_int<1, 2, 3, 4, 5, 6, 8>(vecs == 7 ? 8 : vecs, [&](auto kv) {
      constexpr int kVecs = decltype(kv)::value;
      constexpr int kAheadSample = kVecs < 2 ? kVecs : 2;
      if (packed && per_token) {
        launch(adaln_fwd_warp_kernel<T, kVecs, 1, false, kVecs>);
      } else if (packed) {
        launch(adaln_fwd_warp_kernel<T, kVecs, 1, false, kAheadSample>);
      } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        dispatch_int<1, 2>(rows, [&](auto kr) {
          dispatch_bool(prefetch, [&](auto kp) {
            launch(adaln_fwd_warp_kernel<T, kVecs, decltype(kr)::value, decltype(kp)::value, 0>);
          });
        });
      } else {
        launch(adaln_fwd_warp_kernel<T, kVecs, 1, false, 0>);
      }
    });
  });
  return true;
}

// The bulk-copy forward for aligned, plain calls with rows < 2^31 (checked by the caller); false
// when it does not apply (gated, fewer than 64 vectors per row, ring too large, no sm_90 code,
// or AdaLNTuning::fwd_kernel == 1).
bool try_fwd_tma(const AdaLNFwdParams& p, FwdArgs a, int vec, cudaStream_t stream) {
  const AdaLNTuning& tune = adaln_tuning();
  if (tune.fwd_kernel == 1 || a.gated) return false;
  const std::int64_t nvec = p.dim / vec;
  if (nvec < 64) return false;
  auto reload_for = [&](int elems) {
    return tune.fwd_coef_reload < 0 ? elems > 40 : tune.fwd_coef_reload != 0;
  };
  // AdaLNTuning::fwd_tma_vecs > 0: that many vectors per thread only (padding allowed).
  const int forced[] = {tune.fwd_tma_vecs};
  const bool force = tune.fwd_tma_vecs > 0;
  const VecPlan plan = choose_vec_plan(
      nvec, force ? forced : kFwdVecCandidates,
      force ? 1 : static_cast<int>(std::size(kFwdVecCandidates)),
      [&](int k) { return fwd_tma_max_threads(k * vec, reload_for(k * vec)); }, tune.fwd_target_tpr,
      [&](int k, std::int64_t tpr) {
        // AdaLNTuning::fwd_tma_prefer: among equally padded bf16 plans, 5 vectors per thread,
        // then 3 in whole 4-warp groups (measured; see there).
        if (tune.fwd_tma_prefer == 0 || p.dtype != DType::kBFloat16) return 0;
        return k == 5 ? 2 : (k == 3 && tpr % 128 == 0 ? 1 : 0);
      });
  if (plan.vecs == 0) return false;
  const bool reload = reload_for(plan.vecs * vec);
  // Rows per group: instantiated for <= 3 vectors per thread, coefficients in registers.
  int rows = 1;
  if (plan.vecs <= 3 && !reload && plan.threads >= 64) {
    int want = tune.fwd_tma_rows;
    // Automatic: one row. Groups measured slower on the H200 (bench/results/adaln-kernel-notes.md,
    // v4: D = 1536 77% -> 70% of copy with 2 rows, D = 1024 57% -> 34% with 4 rows: bigger
    // blocks at ~96 registers per thread leave 1-3 blocks per SM instead of 7).
    if (want <= 0) want = 1;
    want = want >= 4 ? 4 : (want >= 2 ? 2 : 1);
    while (want > 1 && plan.threads * want > fwd_tma_max_threads(plan.vecs * vec, false)) {
      want /= 2;
    }
    rows = want;
  }
  const std::int64_t group_bytes = rows * nvec * 16;
  const bool extra =
      p.dtype == DType::kBFloat16 && (plan.vecs == 2 || plan.vecs == 3 || plan.vecs == 5);
  const int stages =
      !extra ? 4 : (tune.fwd_tma_stages > 0 ? tune.fwd_tma_stages : (rows > 1 ? 6 : 4));
  const bool bulk_store =
      !extra || (tune.fwd_bulk_store < 0 ? group_bytes > 4096 : tune.fwd_bulk_store != 0);
  if (static_cast<std::size_t>(stages) * group_bytes > kMaxFwdRingBytes) return false;
  a.evict_first = tune.fwd_evict_first > 0;
  bool launched = false;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_int<1, 2, 3, 4, 5, 6, 8>(plan.vecs, [&](auto kv) {
      constexpr int kVecs = decltype(kv)::value;
      constexpr int kElems = kVecs * 16 / static_cast<int>(sizeof(T));
      constexpr bool kExtra =
          std::is_same_v<T, __nv_bfloat16> && (kVecs == 2 || kVecs == 3 || kVecs == 5);
      if (rows > 1) {
        if constexpr (kVecs <= 3 && fwd_tma_max_threads(kElems, false) > 0) {
          dispatch_int<2, 4>(rows, [&](auto kr) {
            constexpr int kR = decltype(kr)::value;
            if constexpr (kExtra) {
              dispatch_int<3, 4, 6>(stages, [&](auto ks) {
                dispatch_bool(bulk_store, [&](auto kst) {
                  launched = launch_fwd_tma<T, kVecs, decltype(ks)::value, decltype(kst)::value,
                                            false, kR>(a, plan.threads, stream);
                });
              });
            } else {
              launched = launch_fwd_tma<T, kVecs, 4, true, false, kR>(a, plan.threads, stream);
            }
          });
        }
        return;
      }
      dispatch_bool(reload, [&](auto kr) {
        constexpr bool kReload = decltype(kr)::value;
        if constexpr (fwd_tma_max_threads(kElems, kReload) > 0) {
          if constexpr (kExtra) {
            dispatch_int<3, 4, 6>(stages, [&](auto ks) {
              dispatch_bool(bulk_store, [&](auto kst) {
                launched =
                    launch_fwd_tma<T, kVecs, decltype(ks)::value, decltype(kst)::value, kReload, 1>(
                        a, plan.threads, stream);
              });
            });
          } else {
            launched = launch_fwd_tma<T, kVecs, 4, true, kReload, 1>(a, plan.threads, stream);
          }
        }
      });
    });
  });
  return launched;
}

}  // namespace

}  // namespace internal

void adaln_forward_cuda(const AdaLNFwdParams& p, void* stream) {
  using namespace internal;
  adaln_check(p, /*for_gpu=*/true);
  const bool gated = p.gate.data != nullptr;
  FwdArgs a;
  a.rows = p.batch * p.seq_len;
  a.batch = p.batch;
  a.n = p.seq_len;
  a.d = p.dim;
  a.inv_d = 1.0f / static_cast<float>(p.dim);
  a.eps = p.eps;
  a.rms = p.norm == NormType::kRMSNorm;
  a.gated = gated;
  a.x = to_dev(gated ? p.residual : p.x);
  a.branch = to_dev(p.branch);
  a.gate = to_dev(p.gate);
  a.scale = to_dev(p.scale);
  a.shift = to_dev(p.shift);
  a.weight = p.weight;
  a.bias = p.bias;
  a.affine_f32 = p.affine_dtype == DType::kFloat32;
  a.y = p.y;
  a.h = p.h;
  a.mean = p.mean;
  a.rstd = p.rstd;
  auto* cu_stream = static_cast<cudaStream_t>(stream);

  const std::int64_t vec = 16 / static_cast<std::int64_t>(dtype_size(p.dtype));
  const std::int64_t B = p.batch, N = p.seq_len;
  const bool aligned = p.dim % vec == 0 && view_aligned(p.x, B, N) &&
                       view_aligned(p.residual, B, N) && view_aligned(p.branch, B, N) &&
                       view_aligned(p.gate, B, N) && view_aligned(p.scale, B, N) &&
                       view_aligned(p.shift, B, N) && aligned16(p.weight) && aligned16(p.bias) &&
                       aligned16(p.y) && aligned16(p.h);
  const AdaLNTuning& tune = adaln_tuning();
  // The pipelined kernel indexes rows with 32-bit arithmetic.
  if (aligned && tune.pipelined && a.rows < (std::int64_t{1} << 31)) {
    if (try_fwd_warp(p, a, static_cast<int>(vec), cu_stream)) return;
    if (try_fwd_tma(p, a, static_cast<int>(vec), cu_stream)) return;
    const VecPlan plan = choose_vec_plan(
        p.dim / vec, kFwdVecCandidates, static_cast<int>(std::size(kFwdVecCandidates)),
        [&](int k) { return fwd_pipe_max_threads(static_cast<int>(k * vec), 1); },
        tune.fwd_target_tpr);
    if (plan.vecs != 0) {
      const int rows_per_group = std::max(1, 128 / plan.threads);
      const int elems = static_cast<int>(plan.vecs * vec);
      // One row per thread by default: two rows (fewer barriers, more rows per SM) measured
      // slower on the H200 (bench/results/adaln-kernel-notes.md, v2).
      const bool two_fit = fwd_pipe_max_threads(elems, 2) >= plan.threads * rows_per_group;
      const int rows = tune.fwd_rows == 2 && two_fit ? 2 : 1;
      const int stages = p.dtype == DType::kBFloat16 && rows == 2 ? tune.fwd_stages : 3;
      const std::size_t ring_bytes = static_cast<std::size_t>(stages) * rows * (gated ? 2 : 1) *
                                     rows_per_group * plan.threads * plan.vecs * 16;
      if (ring_bytes <= kMaxFwdRingBytes) {
        dispatch_dtype(p.dtype, [&](auto tag) {
          using T = typename decltype(tag)::type;
          dispatch_int<1, 2, 3, 4, 5, 6, 8>(plan.vecs, [&](auto kv) {
            constexpr int kVecs = decltype(kv)::value;
            constexpr int kElems = kVecs * 16 / static_cast<int>(sizeof(T));
            dispatch_int<1, 2>(rows, [&](auto kr) {
              constexpr int kRows = decltype(kr)::value;
              if constexpr (fwd_pipe_max_threads(kElems, kRows) > 0) {
                if constexpr (std::is_same_v<T, __nv_bfloat16> && kRows == 2) {
                  dispatch_int<2, 3, 4>(tune.fwd_stages, [&](auto ks) {
                    launch_fwd_pipe<T, kVecs, decltype(ks)::value, kRows>(a, plan, rows_per_group,
                                                                          cu_stream);
                  });
                } else {
                  launch_fwd_pipe<T, kVecs, 3, kRows>(a, plan, rows_per_group, cu_stream);
                }
              } else {
                DS_FAIL("AdaLN: no pipelined instantiation for ", kVecs, " vectors x ", kRows,
                        " rows per thread");
              }
            });
          });
        });
        return;
      }
    }
  }
  VecPlan plan;
  if (aligned) {
    plan = choose_vec_plan(
        p.dim / vec, kFwdVecCandidates, static_cast<int>(std::size(kFwdVecCandidates)),
        [&](int k) { return fwd_max_threads(static_cast<int>(k * vec)); }, /*target_tpr=*/128);
  }
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (plan.vecs == 0) {
      DS_CHECK(a.rows <= 0x7fffffff, "AdaLNFwdParams: batch * seq_len = ", a.rows,
               " exceeds the grid limit");
      launch_kernel(adaln_fwd_general_kernel<T>, dim3(static_cast<unsigned>(a.rows)),
                    dim3(kGeneralThreads), 0, cu_stream, a);
      return;
    }
    const int rows_per_block = std::max(1, 128 / plan.threads);
    const std::int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
    DS_CHECK(blocks <= 0x7fffffff, "AdaLNFwdParams: too many rows for one grid: ", a.rows);
    const dim3 block(plan.threads, rows_per_block);
    dispatch_int<1, 2, 3, 4, 5, 6, 8>(plan.vecs, [&](auto kv) {
      constexpr int kVecs = decltype(kv)::value;
      launch_kernel(adaln_fwd_vec_kernel<T, kVecs>, dim3(static_cast<unsigned>(blocks)), block, 0,
                    cu_stream, a);
    });
  });
}

}  // namespace ditscale::kernels
