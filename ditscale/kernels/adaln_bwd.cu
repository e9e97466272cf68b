// Fused AdaLN backward with the D-tile coalesced, deterministic reduction. See adaln.h.
//
// adaln_backward_cuda chooses the plan (choose_bwd_plan, internal/adaln_plan.h), then launches the
// zero fill of dmod where needed, the main kernel and the reduction of the partials. Main
// kernel: the pipelined one of internal/adaln_bwd_pipe.cuh; the kernels below are the first
// version (still used when its shared memory would not fit, or with AdaLNTuning::pipelined off)
// and the general path.
// Main kernel: one block per (b, sequence tile of rows_per_tile rows). Threads own features
// (vector j * tpr + t of V = 16 bytes / sizeof(T) elements, so a warp reads contiguous memory) and
// walk down the tile row by row: x and dy are read once, xhat is recomputed from the saved
// mean/rstd, the two row sums of dx (sum dxhat, sum dxhat * xhat) go through warp shuffle + shared
// memory, and dx (and the gated outputs) are written. Gradients reduced over the sequence
// (per-sample dscale/dshift/dgate, dweight/dbias) accumulate in shared-memory slots owned by the
// feature's thread and are written once per tile as fp32 partials [B, tiles, D]; per-token ones
// are written directly.
// Reduce kernel: sums the partials over tiles (and over b for dweight/dbias) in a fixed order.
// No atomics anywhere: the bits depend only on the inputs and the shape.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_bwd_pipe.cuh"
#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_launch.h"
#include "ditscale/kernels/internal/adaln_plan.h"
#include "ditscale/kernels/internal/adaln_tuning.h"
#include "ditscale/kernels/internal/dispatch.h"

namespace ditscale::kernels {
namespace internal {
namespace {

// Register budget: bwd_vec_max_threads (adaln_plan.h).
template <typename T, int kVecs>
__global__ void __launch_bounds__(bwd_vec_max_threads(kVecs * 16 / sizeof(T)), 1)
    adaln_bwd_vec_kernel(const BwdArgs a, const SmemSlots slots) {
  pdl_enter();  // before any global access (adaln_device.cuh)
  constexpr int V = 16 / sizeof(T);
  extern __shared__ float4 acc_smem4[];
  float* const acc_smem = reinterpret_cast<float*>(acc_smem4);
  __shared__ float red[2][64];
  const std::int64_t b = blockIdx.x / a.num_tiles;
  const std::int64_t tile = blockIdx.x - b * a.num_tiles;
  const std::int64_t n0 = tile * a.rows_per_tile;
  const std::int64_t n1 = a.n < n0 + a.rows_per_tile ? a.n : n0 + a.rows_per_tile;
  const int nvec = static_cast<int>(a.d / V);
  const float inv_d = 1.0f / static_cast<float>(a.d);
  auto slot = [&](int s, std::int64_t d) { return acc_smem + s * a.d + d; };

  int parity = 0;
  for (std::int64_t n = n0; n < n1; ++n, parity ^= 1) {
    const bool first = n == n0;
    const std::int64_t row = b * a.n + n;
    const float mean = a.mean[row];
    const float rstd = a.rstd[row];
    float xh[kVecs][V], dxh[kVecs][V];
    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * blockDim.x + threadIdx.x;
      if (vi >= nvec) {
        fill(xh[j], 0.f);
        fill(dxh[j], 0.f);
        continue;
      }
      const std::int64_t d = static_cast<std::int64_t>(vi) * V;
      float dy[V], sc[V], w[V], bi[V];
      load_vec<V>(static_cast<const T*>(a.x.data) + view_offset(a.x, b, n, d), xh[j]);
      if (a.gated) {
        float br[V];
        load_vec<V>(static_cast<const T*>(a.branch.data) + view_offset(a.branch, b, n, d), br);
        recompute_h_vec<V, T>(a, b, n, d, br, xh[j]);
      }
      load_vec<V>(static_cast<const T*>(a.dy.data) + view_offset(a.dy, b, n, d), dy);
      load_view_vec<V, T>(a.scale, view_offset(a.scale, b, n, d), sc);
      fill(w, 1.f);
      fill(bi, 0.f);
      if (a.weight != nullptr) load_view_vec<V, T>(DevView{a.weight, 0, 0, a.affine_f32}, d, w);
      if (a.bias != nullptr) load_view_vec<V, T>(DevView{a.bias, 0, 0, a.affine_f32}, d, bi);
      float dscale[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float xhat = (xh[j][e] - mean) * rstd;
        const float gy = dy[e] * (1.f + sc[e]);
        const float dxhat = gy * w[e];
        dscale[e] = dy[e] * fmaf(xhat, w[e], bi[e]);
        sums[0] += dxhat;
        sums[1] = fmaf(dxhat, xhat, sums[1]);
        xh[j][e] = xhat;
        dxh[j][e] = dxhat;
        sc[e] = gy;        // sc now holds dy * (1 + scale) (dbias contribution)
        w[e] = gy * xhat;  // w now holds the dweight contribution
      }
      if (slots.dscale >= 0) accumulate_vec<V>(slot(slots.dscale, d), first, dscale);
      if (slots.dshift >= 0) accumulate_vec<V>(slot(slots.dshift, d), first, dy);
      if (slots.dweight >= 0) accumulate_vec<V>(slot(slots.dweight, d), first, w);
      if (slots.dbias >= 0) accumulate_vec<V>(slot(slots.dbias, d), first, sc);
      const std::int64_t out = row * a.d + d;
      if (a.dscale_tok != nullptr) store_any_vec<V, T>(a.dscale_tok, a.scale.f32, out, dscale);
      if (a.dshift_tok != nullptr) store_any_vec<V, T>(a.dshift_tok, a.shift.f32, out, dy);
    }
    row_sum<2>(sums, red[parity]);
    const float c1 = a.rms ? 0.f : sums[0] * inv_d;
    const float c2 = sums[1] * inv_d;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * blockDim.x + threadIdx.x;
      if (vi >= nvec) continue;
      const std::int64_t d = static_cast<std::int64_t>(vi) * V;
      const std::int64_t out = row * a.d + d;
      float dx[V];
#pragma unroll
      for (int e = 0; e < V; ++e) dx[e] = rstd * (dxh[j][e] - fmaf(xh[j][e], c2, c1));
      if (a.gated) {
        gated_dx_vec<V, T>(a, b, n, d, out, first,
                           slots.dgate >= 0 ? slot(slots.dgate, d) : nullptr, nullptr, nullptr, dx);
      }
      store_vec<V>(static_cast<T*>(a.dx) + out, dx);
    }
  }

  // Tile partials: each thread copies its own slots (written by itself: no barrier needed).
  const std::int64_t part = static_cast<std::int64_t>(blockIdx.x) * a.d;  // (b, tile) row
  float* const ws[5] = {a.ws_dscale, a.ws_dshift, a.ws_dgate, a.ws_dweight, a.ws_dbias};
  const int ids[5] = {slots.dscale, slots.dshift, slots.dgate, slots.dweight, slots.dbias};
#pragma unroll
  for (int q = 0; q < 5; ++q) {
    if (ids[q] < 0) continue;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * blockDim.x + threadIdx.x;
      if (vi >= nvec) continue;
      const std::int64_t d = static_cast<std::int64_t>(vi) * V;
      float v[V];
      load_vec<V>(slot(ids[q], d), v);
      store_vec<V>(ws[q] + part + d, v);
    }
  }
}

constexpr int kGeneralThreads = 256;

// Any D / alignment: same tiling and partial layout; the partials accumulate in the workspace
// itself (each (b, tile, d) slot is owned by one thread of one block: no race, no atomics).
template <typename T>
__global__ void __launch_bounds__(kGeneralThreads) adaln_bwd_general_kernel(const BwdArgs a) {
  pdl_enter();  // before any global access (adaln_device.cuh)
  __shared__ float red[2][64];
  const std::int64_t b = blockIdx.x / a.num_tiles;
  const std::int64_t tile = blockIdx.x - b * a.num_tiles;
  const std::int64_t n0 = tile * a.rows_per_tile;
  const std::int64_t n1 = a.n < n0 + a.rows_per_tile ? a.n : n0 + a.rows_per_tile;
  const float inv_d = 1.0f / static_cast<float>(a.d);
  const std::int64_t part = static_cast<std::int64_t>(blockIdx.x) * a.d;
  auto accumulate = [&](float* ws, std::int64_t d, bool first, float v) {
    if (ws != nullptr) ws[part + d] = first ? v : ws[part + d] + v;
  };
  int parity = 0;
  for (std::int64_t n = n0; n < n1; ++n, parity ^= 1) {
    const std::int64_t row = b * a.n + n;
    const float mean = a.mean[row];
    const float rstd = a.rstd[row];
    const bool first = n == n0;
    // The norm's input at d: x, or h recomputed from residual, gate and branch (gated).
    auto input = [&](std::int64_t d) {
      const float x = to_f(static_cast<const T*>(a.x.data)[view_offset(a.x, b, n, d)]);
      if (!a.gated) return x;
      return gated_h<T>(x, load_any<T>(a.gate.data, a.gate.f32, view_offset(a.gate, b, n, d)),
                        to_f(static_cast<const T*>(a.branch.data)[view_offset(a.branch, b, n, d)]));
    };
    // Element d: xhat, dy * (1 + scale), weight and bias.
    auto element = [&](std::int64_t d, float& xhat, float& dy, float& gy, float& w, float& bi) {
      xhat = (input(d) - mean) * rstd;
      dy = to_f(static_cast<const T*>(a.dy.data)[view_offset(a.dy, b, n, d)]);
      gy = dy * (1.f + load_any<T>(a.scale.data, a.scale.f32, view_offset(a.scale, b, n, d)));
      w = a.weight != nullptr ? load_any<T>(a.weight, a.affine_f32, d) : 1.f;
      bi = a.bias != nullptr ? load_any<T>(a.bias, a.affine_f32, d) : 0.f;
    };
    float sums[2] = {0.f, 0.f};
    for (std::int64_t d = threadIdx.x; d < a.d; d += blockDim.x) {
      float xhat, dy, gy, w, bi;
      element(d, xhat, dy, gy, w, bi);
      const float dxhat = gy * w;
      const float dscale = dy * fmaf(xhat, w, bi);
      sums[0] += dxhat;
      sums[1] = fmaf(dxhat, xhat, sums[1]);
      accumulate(a.ws_dscale, d, first, dscale);
      accumulate(a.ws_dshift, d, first, dy);
      accumulate(a.ws_dweight, d, first, gy * xhat);
      accumulate(a.ws_dbias, d, first, gy);
      if (a.dscale_tok != nullptr) store_any<T>(a.dscale_tok, a.scale.f32, row * a.d + d, dscale);
      if (a.dshift_tok != nullptr) store_any<T>(a.dshift_tok, a.shift.f32, row * a.d + d, dy);
    }
    row_sum<2>(sums, red[parity]);
    const float c1 = a.rms ? 0.f : sums[0] * inv_d;
    const float c2 = sums[1] * inv_d;
    for (std::int64_t d = threadIdx.x; d < a.d; d += blockDim.x) {
      float xhat, dy, gy, w, bi;
      element(d, xhat, dy, gy, w, bi);
      float dx = rstd * (gy * w - fmaf(xhat, c2, c1));
      const std::int64_t out = row * a.d + d;
      if (a.gated) {
        if (a.dh_out.data != nullptr) {
          dx += to_f(static_cast<const T*>(a.dh_out.data)[view_offset(a.dh_out, b, n, d)]);
        }
        if (a.dbranch != nullptr) {
          const float g = load_any<T>(a.gate.data, a.gate.f32, view_offset(a.gate, b, n, d));
          static_cast<T*>(a.dbranch)[out] = from_f<T>(dx * g);
        }
        if (a.ws_dgate != nullptr || a.dgate_tok != nullptr) {
          const float dg =
              dx * to_f(static_cast<const T*>(a.branch.data)[view_offset(a.branch, b, n, d)]);
          accumulate(a.ws_dgate, d, first, dg);
          if (a.dgate_tok != nullptr) store_any<T>(a.dgate_tok, a.gate.f32, out, dg);
        }
      }
      static_cast<T*>(a.dx)[out] = from_f<T>(dx);
    }
  }
}

// One reduction job: out[b, d] = sum_t ws[b, t, d] (per sample) or out[d] = sum_{b,t} ws[b, t, d].
struct ReduceJob {
  const float* ws = nullptr;
  void* out = nullptr;
  std::int64_t out_sb = 0;  // elements between the samples of out
  bool out_f32 = false;
  bool over_batch = false;
};
// Rows of AdaLNBwdParams::dmod that no output fills, zeroed by the blocks of job 0 (per sample):
// element (b, d) of zero row k is at dmod + b * sb + rows[k] + d.
constexpr int kMaxZeroRows = 16;
struct ZeroRows {
  void* dmod = nullptr;
  std::int64_t sb = 0;
  bool f32 = false;
  int count = 0;
  std::int64_t rows[kMaxZeroRows] = {};
};
struct ReduceArgs {
  ReduceJob jobs[5];
  ZeroRows zero;
  std::int64_t batch = 0;
  std::int64_t num_tiles = 0;
  std::int64_t d = 0;
};

constexpr int kReduceCols = 32;   // features per block (one warp-wide coalesced row segment)
constexpr int kReduceRows = 32;   // partial rows summed in parallel, then combined in order
constexpr int kReduceUnroll = 8;  // loads a thread has in flight

// grid: (ceil(D / 32) * B, jobs). Thread (tx, ty) sums partial rows ty, ty + 32, ... in order
// (loads issued 8 at a time); the 32 column sums are then added in ty order: a fixed tree,
// identical every run. 32 x 8 loads per column in flight: the ~10 MB of partials of a backward
// with ~800 blocks at D = 1536 took 5.2 us with 16 x 4 (bench/adaln/profile_adaln.py). The
// blocks of job 0 also write the zero rows of the modulation gradient for their (b, features).
// (Measured and not kept, adaln-kernel-notes.md v12: 16 features x 64 rows with 16-byte loads
// and a tree combine, 4.5-5.5 us against 3.9-4.1; the zero rows as jobs of their own, 1024-thread
// blocks that store 32 values each: +0.8 us.)
template <typename T>
__global__ void __launch_bounds__(kReduceCols* kReduceRows)
    adaln_reduce_partials_kernel(const ReduceArgs r) {
  __shared__ float part[kReduceRows][kReduceCols + 1];
  pdl_enter();
  const ReduceJob& job = r.jobs[blockIdx.y];
  const std::int64_t chunks = (r.d + kReduceCols - 1) / kReduceCols;
  const std::int64_t b = blockIdx.x / chunks;
  const std::int64_t d = (blockIdx.x - b * chunks) * kReduceCols + threadIdx.x;
  if (job.over_batch && b != 0) return;  // whole block: no barrier is skipped by a subset
  if (blockIdx.y == 0 && threadIdx.y == 0 && d < r.d) {
    for (int k = 0; k < r.zero.count; ++k) {
      store_any<T>(r.zero.dmod, r.zero.f32, b * r.zero.sb + r.zero.rows[k] + d, 0.f);
    }
  }
  const std::int64_t rows = job.over_batch ? r.batch * r.num_tiles : r.num_tiles;
  const float* src = job.ws + (job.over_batch ? 0 : b * r.num_tiles * r.d) + d;
  float s = 0.f;
  if (d < r.d) {
    std::int64_t t = threadIdx.y;
    for (; t + (kReduceUnroll - 1) * kReduceRows < rows; t += kReduceUnroll * kReduceRows) {
      float v[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) v[u] = src[(t + u * kReduceRows) * r.d];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) s += v[u];
    }
    for (; t < rows; t += kReduceRows) s += src[t * r.d];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || d >= r.d) return;
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kReduceRows; ++k) total += part[k][threadIdx.x];
  store_any<T>(job.out, job.out_f32, (job.over_batch ? 0 : b * job.out_sb) + d, total);
}

// Dynamic shared memory of the pipelined backward (adaln_bwd_pipe.cuh): the ring (`streams` rows
// of chunks a stage: bwd_pipe_streams), then the slots.
std::size_t bwd_pipe_smem(int stages, int streams, int threads, int vecs, int num_slots,
                          std::int64_t dim) {
  return static_cast<std::size_t>(stages) * streams * threads * vecs * 16 +
         static_cast<std::size_t>(num_slots) * dim * sizeof(float);
}

// Launches the pipelined backward: picks the tiles per sample so that B x tiles blocks fill one
// wave of resident blocks (at most max_tiles, the workspace's capacity) and writes the tiling
// into `a` (the partial reduction reads it).
template <typename T, int kVecs, int kStages, bool kLean, int kRegCap = 0>
void launch_bwd_pipe(BwdArgs& a, const SmemSlots& slots, int num_slots, int threads,
                     std::int64_t batch, std::int64_t max_tiles, cudaStream_t stream) {
  auto* kernel = adaln_bwd_pipe_kernel<T, kVecs, kStages, kLean, kRegCap>;
  const int streams = bwd_pipe_streams(!kLean && a.gated, a.dh_out.data != nullptr);
  const std::size_t smem = bwd_pipe_smem(kStages, streams, threads, kVecs, num_slots, a.d);
  const std::int64_t resident = resident_blocks(kernel, threads, smem);
  const std::int64_t want = std::clamp<std::int64_t>(resident / batch, 1, max_tiles);
  a.rows_per_tile = (a.n + want - 1) / want;
  a.num_tiles = (a.n + a.rows_per_tile - 1) / a.rows_per_tile;
  const std::int64_t blocks = batch * a.num_tiles;
  DS_CHECK(blocks <= 0x7fffffff, "AdaLNBwdParams: too many sequence tiles: ", blocks);
  launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), smem, stream, a, slots);
}

// The register-capped instantiation (BwdPlan::reg_cap_candidate: lean bf16, two-row ring, 4
// vectors per thread) where the uncapped kernel fits at most 2 blocks per SM and the capped one
// more. Measured (kernel bench, backward % of the copy bandwidth, adaln-kernel-notes.md v13):
// D = 5120 (160 threads, 2 -> 3 blocks) +2 to +6 points, D = 8192 (256 threads, 1 -> 2) +5 to +8;
// D = 4096 (128 threads, 3 -> 4) 3 points slower, and at 3 vectors per thread (D = 1536 / 3072,
// 6 -> 8 / 3 -> 4 blocks) 1-3 points slower.
bool bwd_reg_capped(int threads, int num_slots, std::int64_t dim) {
  constexpr int kVecs = 4;
  const std::size_t smem = bwd_pipe_smem(2, 2, threads, kVecs, num_slots, dim);
  const int uncapped =
      blocks_per_sm(adaln_bwd_pipe_kernel<__nv_bfloat16, kVecs, 2, true>, threads, smem);
  return uncapped <= 2 &&
         blocks_per_sm(adaln_bwd_pipe_kernel<__nv_bfloat16, kVecs, 2, true, kBwdRegCap>, threads,
                       smem) > uncapped;
}

// The backward's arguments: views, outputs, and the workspace's partial blocks (`layout`).
BwdArgs bwd_args(const AdaLNBwdParams& p, const BwdWorkspaceLayout& layout) {
  const bool gated = p.gate.data != nullptr;
  float* ws = static_cast<float*>(p.workspace);
  int slot = 0;
  auto next_slot = [&](bool present) -> float* {
    return present ? ws + layout.offset(slot++) : nullptr;
  };
  BwdArgs a;
  a.n = p.seq_len;
  a.d = p.dim;
  a.rows_per_tile = layout.rows_per_tile;
  a.num_tiles = layout.num_tiles;
  a.rms = p.norm == NormType::kRMSNorm;
  a.gated = gated;
  a.x = to_dev(gated ? p.residual : p.x);
  a.dy = to_dev(p.dy);
  a.dh_out = to_dev(p.dh_out);
  a.branch = to_dev(p.branch);
  a.gate = to_dev(p.gate);
  a.scale = to_dev(p.scale);
  a.shift = to_dev(p.shift);
  a.weight = p.weight;
  a.bias = p.bias;
  a.affine_f32 = p.affine_dtype == DType::kFloat32;
  a.mean = p.mean;
  a.rstd = p.rstd;
  a.dx = p.dx;
  a.dbranch = p.dbranch;
  a.dscale_tok = is_per_token(p.scale) ? p.dscale : nullptr;
  a.dshift_tok = is_per_token(p.shift) ? p.dshift : nullptr;
  a.dgate_tok = gated && is_per_token(p.gate) ? p.dgate : nullptr;
  a.ws_dscale = next_slot(layout.dscale);
  a.ws_dshift = next_slot(layout.dshift);
  a.ws_dgate = next_slot(layout.dgate);
  a.ws_dweight = next_slot(layout.dweight);
  a.ws_dbias = next_slot(layout.dbias);
  return a;
}

// The main kernel of `plan` for element type T; updates the tiling in `a` (pipelined kernel).
template <typename T>
void launch_bwd_main(const BwdPlan& plan, BwdArgs& a, const BwdWorkspaceLayout& layout,
                     std::int64_t batch, cudaStream_t stream) {
  // Slots: every reduced quantity in shared memory for the first kernel; the pipelined one keeps
  // dscale / dshift in registers.
  SmemSlots slots;
  int used = 0;
  if (plan.kernel != BwdKernel::kPipe && a.ws_dscale != nullptr) slots.dscale = used++;
  if (plan.kernel != BwdKernel::kPipe && a.ws_dshift != nullptr) slots.dshift = used++;
  if (a.ws_dgate != nullptr) slots.dgate = used++;
  if (a.ws_dweight != nullptr) slots.dweight = used++;
  if (a.ws_dbias != nullptr) slots.dbias = used++;
  const std::int64_t blocks = batch * layout.num_tiles;
  DS_CHECK(blocks <= 0x7fffffff, "AdaLNBwdParams: too many sequence tiles: ", blocks);
  if (plan.kernel == BwdKernel::kGeneral) {
    launch_kernel(adaln_bwd_general_kernel<T>, dim3(static_cast<unsigned>(blocks)),
                  dim3(kGeneralThreads), 0, stream, a);
    return;
  }
  dispatch_int<1, 2, 3, 4>(plan.vecs, [&](auto kv) {
    constexpr int kVecs = decltype(kv)::value;
    if (plan.kernel == BwdKernel::kVec) {
      auto* kernel = adaln_bwd_vec_kernel<T, kVecs>;
      const std::size_t smem = static_cast<std::size_t>(used) * a.d * sizeof(float);
      if (smem > 32 * 1024) {  // static shared memory counts against the 48 KB default
        DS_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
      }
      launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(plan.threads), smem, stream,
                    a, slots);
      return;
    }
    const std::int64_t tiles = layout.num_tiles;
    if (!plan.lean) {
      if constexpr (sizeof(T) == 2) {
        if (plan.stages == 2) {
          launch_bwd_pipe<T, kVecs, 2, false>(a, slots, used, plan.threads, batch, tiles, stream);
          return;
        }
      }
      launch_bwd_pipe<T, kVecs, 3, false>(a, slots, used, plan.threads, batch, tiles, stream);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if constexpr (kVecs == 4) {
        if (plan.reg_cap_candidate && bwd_reg_capped(plan.threads, used, a.d)) {
          launch_bwd_pipe<T, kVecs, 2, true, kBwdRegCap>(a, slots, used, plan.threads, batch, tiles,
                                                         stream);
          return;
        }
      }
      launch_bwd_pipe<T, kVecs, 2, true>(a, slots, used, plan.threads, batch, tiles, stream);
    } else {
      launch_bwd_pipe<T, kVecs, 3, true>(a, slots, used, plan.threads, batch, tiles, stream);
    }
  });
}

// Rows of p.dmod that no output fills (adaln.h): zeroed by the reduce kernel's first job (a
// per-sample one, first in job order), or, with more than kMaxZeroRows or no such job, by one
// memset ahead of everything else (returns true then).
bool zero_dmod_ahead(const AdaLNBwdParams& p, const BwdWorkspaceLayout& layout,
                     const std::vector<std::int64_t>& zero_rows, cudaStream_t stream) {
  const bool zero_all = !zero_rows.empty() && (zero_rows.size() > kMaxZeroRows ||
                                               !(layout.dscale || layout.dshift || layout.dgate));
  if (zero_all) {
    DS_CHECK_CUDA(cudaMemsetAsync(
        p.dmod, 0,
        static_cast<std::size_t>(p.batch * p.dmod_rows * p.dim) * dtype_size(p.dmod_dtype),
        stream));
  }
  return zero_all;
}

// Sums the partials of the reduced gradients (and writes the zero rows of dmod) in one launch.
template <typename T>
void launch_bwd_reduce(const AdaLNBwdParams& p, const BwdArgs& a,
                       const std::vector<std::int64_t>& zero_rows, bool zeroed,
                       cudaStream_t stream) {
  ReduceArgs r;
  r.batch = p.batch;
  r.num_tiles = a.num_tiles;  // the pipelined launch may use fewer tiles than the layout holds
  r.d = p.dim;
  int jobs = 0;
  auto add_job = [&](const float* src, void* out, std::int64_t out_sb, DType out_dtype,
                     bool over_batch) {
    if (src == nullptr) return;
    r.jobs[jobs++] =
        ReduceJob{src, out, out_sb > 0 ? out_sb : p.dim, out_dtype == DType::kFloat32, over_batch};
  };
  add_job(a.ws_dscale, p.dscale, p.dscale_stride_b, p.scale.dtype, false);
  add_job(a.ws_dshift, p.dshift, p.dshift_stride_b, p.shift.dtype, false);
  add_job(a.ws_dgate, p.dgate, p.dgate_stride_b, p.gate.dtype, false);
  add_job(a.ws_dweight, p.dweight, 0, p.affine_dtype, true);
  add_job(a.ws_dbias, p.dbias, 0, p.affine_dtype, true);
  if (!zeroed && !zero_rows.empty()) {  // job 0 is per sample here (see zero_dmod_ahead)
    r.zero.dmod = p.dmod;
    r.zero.sb = p.dmod_rows * p.dim;
    r.zero.f32 = p.dmod_dtype == DType::kFloat32;
    r.zero.count = static_cast<int>(zero_rows.size());
    for (int k = 0; k < r.zero.count; ++k) r.zero.rows[k] = zero_rows[k] * p.dim;
  }
  if (jobs == 0) return;
  const std::int64_t chunks = (p.dim + kReduceCols - 1) / kReduceCols;
  DS_CHECK(chunks * p.batch <= 0x7fffffff, "AdaLNBwdParams: batch * dim too large for one grid");
  const dim3 grid(static_cast<unsigned>(chunks * p.batch), static_cast<unsigned>(jobs));
  launch_kernel(adaln_reduce_partials_kernel<T>, grid, dim3(kReduceCols, kReduceRows), 0, stream,
                r);
}

}  // namespace
}  // namespace internal

// Choose the plan (adaln_plan.h), then launch: the zero fill of dmod where needed, the main
// kernel, the reduction of the partials.
void internal::adaln_backward_cuda_tuned(const AdaLNBwdParams& p, void* stream,
                                         const AdaLNTuning& tuning) {
  const ScopedAdaLNTuning scope(tuning);
  adaln_check(p, /*for_gpu=*/true);
  const BwdPlan plan = choose_bwd_plan(p, tuning);
  const BwdWorkspaceLayout layout = bwd_workspace_layout(p);
  BwdArgs a = bwd_args(p, layout);
  auto* cu_stream = static_cast<cudaStream_t>(stream);
  const std::vector<std::int64_t> zero_rows = dmod_zero_rows(p);
  const bool zeroed = zero_dmod_ahead(p, layout, zero_rows, cu_stream);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_bwd_main<T>(plan, a, layout, p.batch, cu_stream);
    launch_bwd_reduce<T>(p, a, zero_rows, zeroed, cu_stream);
  });
}

void adaln_backward_cuda(const AdaLNBwdParams& p, void* stream) {
  internal::adaln_backward_cuda_tuned(p, stream, internal::AdaLNTuning{});
}

}  // namespace ditscale::kernels
