// Fused AdaLN forward: one read of x (or residual + gate * branch), one write of y (and h), fp32
// statistics kept in registers. See adaln.h for the math and layouts.
//
// adaln_forward_cuda chooses the plan (choose_fwd_plan, internal/adaln_plan.h), then launches it.
// Plans: plain (not gated) calls with rows of <= 256 16-byte vectors take the warp-per-row
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
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_fwd_pipe.cuh"
#include "ditscale/kernels/internal/adaln_fwd_tma.cuh"
#include "ditscale/kernels/internal/adaln_fwd_warp.cuh"
#include "ditscale/kernels/internal/adaln_launch.h"
#include "ditscale/kernels/internal/adaln_plan.h"
#include "ditscale/kernels/internal/adaln_tuning.h"
#include "ditscale/kernels/internal/dispatch.h"

namespace ditscale::kernels {
namespace internal {
namespace {

// The gated variant's inputs of vector d (feature offset) of sample b, token n: residual r,
// gate g and branch br (h = r + g * br).
template <typename T, int V>
__device__ __forceinline__ void fwd_vec_gated_inputs(const FwdArgs& a, std::int64_t b,
                                                     std::int64_t n, std::int64_t d, float (&r)[V],
                                                     float (&g)[V], float (&br)[V]) {
  load_vec<V>(static_cast<const T*>(a.x.data) + view_offset(a.x, b, n, d), r);
  load_view_vec<V, T>(a.gate, view_offset(a.gate, b, n, d), g);
  load_vec<V>(static_cast<const T*>(a.branch.data) + view_offset(a.branch, b, n, d), br);
}

// The modulation and affine of vector d of sample b, token n: scale, shift, weight w (1 without
// one) and bias bi (0 without one).
template <typename T, int V>
__device__ __forceinline__ void fwd_vec_modulation(const FwdArgs& a, std::int64_t b, std::int64_t n,
                                                   std::int64_t d, float (&sc)[V], float (&sh)[V],
                                                   float (&w)[V], float (&bi)[V]) {
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
}

// Register budget: fwd_vec_max_threads (adaln_plan.h).
template <typename T, int kVecs>
__global__ void __launch_bounds__(fwd_vec_max_threads(kVecs * 16 / sizeof(T)), 1)
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
  float v[kVecs][V];  // the row's input (x, or h when gated), by vectors; zeros past the row
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = j * blockDim.x + threadIdx.x;
    const std::int64_t d = static_cast<std::int64_t>(vi) * V;
    if (row_ok && vi < nvec) {
      if (a.gated) {
        float r[V], g[V], br[V];
        fwd_vec_gated_inputs<T, V>(a, b, n, d, r, g, br);
#pragma unroll
        for (int e = 0; e < V; ++e) v[j][e] = gated_h<T>(r[e], g[e], br[e]);
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
    fwd_vec_modulation<T, V>(a, b, n, d, sc, sh, w, bi);
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
      val = gated_h<T>(r, g, br);
      h[d] = from_f<T>(val);
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

// Launches the pipelined kernel with a grid of (resident blocks per SM) x SMs, capped by the work.
template <typename T, int kVecs>
void launch_fwd_pipe(const FwdArgs& a, const FwdPlan& plan, cudaStream_t stream) {
  constexpr int kStages = 3;
  auto* kernel = adaln_fwd_pipe_kernel<T, kVecs, kStages, 1>;
  const int streams = a.gated ? 2 : 1;
  const std::size_t smem =
      static_cast<std::size_t>(kStages) * streams * plan.rows_per_block * plan.threads * kVecs * 16;
  const int threads = plan.threads * plan.rows_per_block;
  const std::int64_t items = (a.rows + plan.rows_per_block - 1) / plan.rows_per_block;
  const std::int64_t grid = persistent_grid(kernel, threads, smem, items);
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(plan.threads, plan.rows_per_block),
                smem, stream, a, items);
}

// Launches the bulk-copy kernel (one row per block iteration, persistent grid).
template <typename T, int kVecs, bool kBulkStore, bool kCoefReload>
void launch_fwd_tma(const FwdArgs& a, const FwdPlan& plan, cudaStream_t stream) {
  constexpr int kStages = 4;
  auto* kernel = adaln_fwd_tma_kernel<T, kVecs, kStages, kBulkStore, kCoefReload>;
  const std::size_t smem = static_cast<std::size_t>(kStages) * a.d * sizeof(T);
  const std::int64_t grid = persistent_grid(kernel, plan.threads, smem, a.rows);
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(plan.threads), smem, stream, a);
}

// True when the current device runs the bulk-copy kernel: sm_90+ with sm_90 code in this build
// (the binary version the device loads). Cached per device.
bool tma_available() {
  static std::atomic<signed char> cached[64] = {};
  int device = 0;
  DS_CHECK_CUDA(cudaGetDevice(&device));
  if (device >= 0 && device < 64 && cached[device].load(std::memory_order_relaxed) != 0) {
    return cached[device].load(std::memory_order_relaxed) > 0;
  }
  cudaFuncAttributes attr{};
  DS_CHECK_CUDA(
      cudaFuncGetAttributes(&attr, adaln_fwd_tma_kernel<__nv_bfloat16, 4, 4, true, false>));
  const bool ok = attr.binaryVersion >= 90;
  if (device >= 0 && device < 64) cached[device].store(ok ? 1 : -1, std::memory_order_relaxed);
  return ok;
}

// The warp-per-row kernel. Grid: with packed coefficients (token blocks, samples); with prefetch
// one wave of resident blocks; otherwise every row in one pass. AdaLNTuning::max_resident_blocks
// caps the grid for tests.
template <typename T, int kVecs, bool kPrefetch, int kAhead>
void launch_fwd_warp(const FwdArgs& a, const AdaLNFwdParams& p, cudaStream_t stream) {
  auto* kernel = adaln_fwd_warp_kernel<T, kVecs, 1, kPrefetch, kAhead>;
  const int cap = adaln_tuning().max_resident_blocks;
  const dim3 block(32, kFwdWarpsPerBlock);
  if constexpr (kAhead > 0) {
    std::int64_t gx = (p.seq_len + kFwdWarpsPerBlock - 1) / kFwdWarpsPerBlock;
    const std::int64_t gy = std::min<std::int64_t>(p.batch, 65535);
    if (cap > 0) gx = std::max<std::int64_t>(1, std::min<std::int64_t>(gx, cap / gy));
    DS_CHECK(gx >= 1 && gx <= 0x7fffffff, "AdaLN: invalid grid size ", gx);
    launch_kernel(kernel, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), block, 0,
                  stream, a);
    return;
  }
  const std::int64_t blocks = (a.rows + kFwdWarpsPerBlock - 1) / kFwdWarpsPerBlock;
  std::int64_t grid = blocks;
  if (kPrefetch) {
    grid = persistent_grid(kernel, 32 * kFwdWarpsPerBlock, 0, blocks);
  } else if (cap > 0) {
    grid = std::min<std::int64_t>(grid, cap);
  }
  DS_CHECK(grid >= 1 && grid <= 0x7fffffff, "AdaLN: invalid grid size ", grid);
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), block, 0, stream, a);
}

template <typename T, int kVecs>
void launch_fwd_vec(const FwdArgs& a, const FwdPlan& plan, cudaStream_t stream) {
  const std::int64_t blocks = (a.rows + plan.rows_per_block - 1) / plan.rows_per_block;
  DS_CHECK(blocks <= 0x7fffffff, "AdaLNFwdParams: too many rows for one grid: ", a.rows);
  launch_kernel(adaln_fwd_vec_kernel<T, kVecs>, dim3(static_cast<unsigned>(blocks)),
                dim3(plan.threads, plan.rows_per_block), 0, stream, a);
}

template <typename T>
void launch_fwd_general(const FwdArgs& a, cudaStream_t stream) {
  DS_CHECK(a.rows <= 0x7fffffff, "AdaLNFwdParams: batch * seq_len = ", a.rows,
           " exceeds the grid limit");
  launch_kernel(adaln_fwd_general_kernel<T>, dim3(static_cast<unsigned>(a.rows)),
                dim3(kGeneralThreads), 0, stream, a);
}

// The instantiation of `plan` for element type T.
template <typename T>
void launch_fwd(const FwdPlan& plan, const FwdArgs& a, const AdaLNFwdParams& p,
                cudaStream_t stream) {
  if (plan.kernel == FwdKernel::kGeneral) return launch_fwd_general<T>(a, stream);
  dispatch_int<1, 2, 3, 4, 5, 6, 8>(plan.vecs, [&](auto kv) {
    constexpr int kVecs = decltype(kv)::value;
    constexpr int kElems = kVecs * 16 / static_cast<int>(sizeof(T));
    constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    switch (plan.kernel) {
      case FwdKernel::kWarp:
        if (plan.ahead == kVecs) {  // packed, per token (or kVecs <= 2)
          launch_fwd_warp<T, kVecs, false, kVecs>(a, p, stream);
        } else if (plan.ahead > 0) {  // packed, per sample
          launch_fwd_warp<T, kVecs, false, (kVecs < 2 ? kVecs : 2)>(a, p, stream);
        } else if (kBf16 && plan.prefetch) {
          launch_fwd_warp<T, kVecs, kBf16, 0>(a, p, stream);
        } else {
          launch_fwd_warp<T, kVecs, false, 0>(a, p, stream);
        }
        return;
      case FwdKernel::kTma:
        dispatch_bool(plan.coef_reload, [&](auto kr) {
          constexpr bool kReload = decltype(kr)::value;
          constexpr bool kThreadStores = kBf16 && (kVecs == 2 || kVecs == 3 || kVecs == 5);
          if constexpr (fwd_tma_max_threads(kElems, kReload) > 0) {
            if constexpr (kThreadStores) {
              dispatch_bool(plan.bulk_store, [&](auto kb) {
                launch_fwd_tma<T, kVecs, decltype(kb)::value, kReload>(a, plan, stream);
              });
            } else {
              launch_fwd_tma<T, kVecs, true, kReload>(a, plan, stream);
            }
          } else {
            DS_FAIL("AdaLN: no bulk-copy instantiation for ", kVecs, " vectors per thread");
          }
        });
        return;
      case FwdKernel::kPipe:
        if constexpr (fwd_pipe_max_threads(kElems) > 0) {
          launch_fwd_pipe<T, kVecs>(a, plan, stream);
        } else {
          DS_FAIL("AdaLN: no pipelined instantiation for ", kVecs, " vectors per thread");
        }
        return;
      case FwdKernel::kVec:
        launch_fwd_vec<T, kVecs>(a, plan, stream);
        return;
      case FwdKernel::kGeneral:
        return;
    }
  });
}

FwdArgs fwd_args(const AdaLNFwdParams& p, const FwdPlan& plan) {
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
  a.evict_first = plan.evict_first;
  return a;
}

}  // namespace

}  // namespace internal

// Choose the plan (adaln_plan.h), then launch its instantiation.
void internal::adaln_forward_cuda_tuned(const AdaLNFwdParams& p, void* stream,
                                        const AdaLNTuning& tuning) {
  const ScopedAdaLNTuning scope(tuning);
  adaln_check(p, /*for_gpu=*/true);
  const FwdPlan plan = choose_fwd_plan(p, tma_available(), tuning);
  const FwdArgs a = fwd_args(p, plan);
  dispatch_dtype(p.dtype, [&](auto tag) {
    launch_fwd<typename decltype(tag)::type>(plan, a, p, static_cast<cudaStream_t>(stream));
  });
}

void adaln_forward_cuda(const AdaLNFwdParams& p, void* stream) {
  internal::adaln_forward_cuda_tuned(p, stream, internal::AdaLNTuning{});
}

}  // namespace ditscale::kernels
