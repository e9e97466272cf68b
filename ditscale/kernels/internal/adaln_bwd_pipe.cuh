// Pipelined AdaLN backward kernel (vector path) and the pieces it shares with the first backward
// kernel. Included by adaln_bwd.cu only.
//
// Why: the first kernel held a row's xhat and dxhat in registers across the row reduction, used
// ~100 registers per thread in blocks of up to 512 threads (one resident block per SM), and loaded
// each row only when the previous one was done: the SMs waited on memory most of the time. Here:
// - blocks of ~128 threads, each thread owning kVecs 16-byte feature vectors;
// - x and dy of the rows kStages - 1 ahead (gated: residual, dy, branch and dh_out, every
//   [B, N, D] input) stream into a per-thread shared-memory ring with cp.async
//   (adaln_device.cuh), so loads are always in flight;
// - the row data is not kept in registers across the reduction: the second pass re-reads the
//   thread's own chunks from the ring and recomputes xhat and dxhat (cheap arithmetic);
// - per-sample (1 + scale) and the dscale/dshift accumulators live in registers; the rarer
//   reduced gradients (dgate, dweight, dbias) accumulate in thread-owned shared-memory slots;
// - mean/rstd of the next row are loaded one row ahead;
// - the launcher picks the tiles per sample so that B x tiles blocks form one wave of resident
//   blocks (no tail wave); the partials stay [B, tiles, D] fp32, reduced by the second kernel.
// One block reduction (two sums, one barrier) per row.
#pragma once

#include <cstdint>

#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_plan.h"

namespace ditscale::kernels::internal {

// acc[0..V) (+)= v: the first row of a tile initialises its slot.
template <int V>
__device__ __forceinline__ void accumulate_vec(float* acc, bool first, const float (&v)[V]) {
  float old[V];
  if (first) {
    fill(old, 0.f);
  } else {
    load_vec<V>(acc, old);
  }
#pragma unroll
  for (int e = 0; e < V; ++e) old[e] += v[e];
  store_vec<V>(acc, old);
}

// h of the 16-byte vector at feature d of row (b, n) from its residual (in `x`, replaced) and
// branch: gated_h, the forward's arithmetic.
template <int V, typename T>
__device__ __forceinline__ void recompute_h_vec(const BwdArgs& a, std::int64_t b, std::int64_t n,
                                                std::int64_t d, const float (&br)[V],
                                                float (&x)[V]) {
  float g[V];
  load_view_vec<V, T>(a.gate, view_offset(a.gate, b, n, d), g);
#pragma unroll
  for (int e = 0; e < V; ++e) x[e] = gated_h<T>(x[e], g[e], br[e]);
}

// The gated part of dx for the 16-byte vector at feature d of row (b, n) (output offset `out`):
// adds the downstream dh, writes dbranch = gate * dx, and forms dgate = branch * dx, accumulated
// in the thread's own shared-memory slot `dgate_acc` (null: not reduced) and written per token
// where asked. `branch` / `dh`: the row's branch / dh_out values when the caller has them (null:
// loaded here; dh only where a.dh_out is present). Shared by both backward kernels.
template <int V, typename T>
__device__ __forceinline__ void gated_dx_vec(const BwdArgs& a, std::int64_t b, std::int64_t n,
                                             std::int64_t d, std::int64_t out, bool first,
                                             float* dgate_acc, const float* branch, const float* dh,
                                             float (&dx)[V]) {
  if (dh != nullptr) {
#pragma unroll
    for (int e = 0; e < V; ++e) dx[e] += dh[e];
  } else if (a.dh_out.data != nullptr) {
    float dh_row[V];
    load_vec<V>(static_cast<const T*>(a.dh_out.data) + view_offset(a.dh_out, b, n, d), dh_row);
#pragma unroll
    for (int e = 0; e < V; ++e) dx[e] += dh_row[e];
  }
  if (a.dbranch != nullptr) {
    float g[V];
    load_view_vec<V, T>(a.gate, view_offset(a.gate, b, n, d), g);
#pragma unroll
    for (int e = 0; e < V; ++e) g[e] *= dx[e];
    store_vec<V>(static_cast<T*>(a.dbranch) + out, g);
  }
  if (dgate_acc != nullptr || a.dgate_tok != nullptr) {
    float dg[V];
    if (branch != nullptr) {
#pragma unroll
      for (int e = 0; e < V; ++e) dg[e] = branch[e];
    } else {
      load_vec<V>(static_cast<const T*>(a.branch.data) + view_offset(a.branch, b, n, d), dg);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) dg[e] *= dx[e];
    if (dgate_acc != nullptr) accumulate_vec<V>(dgate_acc, first, dg);
    if (a.dgate_tok != nullptr) store_any_vec<V, T>(a.dgate_tok, a.gate.f32, out, dg);
  }
}

// Reduced gradients that accumulate in dynamic shared memory, [slot][D] fp32, each element owned
// by the one thread that owns its feature (no barrier, no race). Slot index or -1 when absent.
struct SmemSlots {
  int dscale = -1, dshift = -1, dgate = -1, dweight = -1, dbias = -1;
};

// Launch bound of an instantiation: bwd_pipe_bound (adaln_plan.h; kRegCap > 0: the
// register-capped instantiation, kBwdRegCap).

// Dynamic shared memory: ring [kStages][streams][tpr * kVecs] 16-byte chunks (streams, in this
// order: x, dy; gated: residual, dy, branch (h is recomputed from residual and branch) and
// dh_out where present: bwd_pipe_streams), then the slots
// [slots.{dgate,dweight,dbias}][D] fp32 (slots.dscale / slots.dshift are unused here: those
// accumulate in registers).
//
// kLean: no affine and no gate (the usual DiT case): those code paths are compiled out, which
// keeps the register count (and thus the resident blocks) in check.
template <typename T, int kVecs, int kStages, bool kLean, int kRegCap = 0>
__global__ void __launch_bounds__(bwd_pipe_bound(kVecs * 16 / sizeof(T), kRegCap), 1)
    adaln_bwd_pipe_kernel(const BwdArgs a, const SmemSlots slots) {
  pdl_enter();  // before any global access (adaln_device.cuh)
  // Lean 16-bit rows: the arithmetic folded (pass 1: xhat by one FMA, dscale accumulated by FMA;
  // pass 2: dx by three operations; see there) and bf16 unpacked by bit operations
  // (adaln-kernel-notes.md v9).
  constexpr bool kFast = kLean && sizeof(T) == 2;
  constexpr int V = 16 / sizeof(T);
  constexpr int P = kStages - 1;
  extern __shared__ uint4 bwd_smem[];
  __shared__ float red[2][64];
  const int tpr = blockDim.x;
  const int tx = threadIdx.x;
  const int nvec = static_cast<int>(a.d / V);
  const int row_vecs = tpr * kVecs;
  const bool gated = !kLean && a.gated;
  const bool has_dh = gated && a.dh_out.data != nullptr;
  const int streams = bwd_pipe_streams(gated, has_dh);
  uint4* const mine = bwd_smem + tx;
  float* const acc_smem = reinterpret_cast<float*>(bwd_smem + kStages * streams * row_vecs);
  const std::int64_t b = blockIdx.x / a.num_tiles;
  const std::int64_t tile = blockIdx.x - b * a.num_tiles;
  const std::int64_t n0 = tile * a.rows_per_tile;
  const std::int64_t n1 = a.n < n0 + a.rows_per_tile ? a.n : n0 + a.rows_per_tile;
  const float inv_d = 1.0f / static_cast<float>(a.d);
  const T* const xb = static_cast<const T*>(a.x.data) + b * a.x.sb;
  const T* const dyb = static_cast<const T*>(a.dy.data) + b * a.dy.sb;
  const bool scale_per_token = a.scale.sn != 0;
  const bool affine = !kLean && (a.weight != nullptr || a.bias != nullptr);
  const T* const brb = gated ? static_cast<const T*>(a.branch.data) + b * a.branch.sb : nullptr;
  const T* const dhb = has_dh ? static_cast<const T*>(a.dh_out.data) + b * a.dh_out.sb : nullptr;
  auto slot = [&](int s, std::int64_t d) { return acc_smem + s * a.d + d; };

  auto issue = [&](std::int64_t n, int stage) {
    if (n < n1) {
      uint4* dst = mine + stage * streams * row_vecs;
      const T* px = xb + n * a.x.sn;
      const T* pdy = dyb + n * a.dy.sn;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int vi = j * tpr + tx;
        if (vi < nvec) {
          cp_async16(dst + j * tpr, px + vi * V);
          cp_async16(dst + row_vecs + j * tpr, pdy + vi * V);
          if (gated) cp_async16(dst + 2 * row_vecs + j * tpr, brb + n * a.branch.sn + vi * V);
          if (has_dh) cp_async16(dst + 3 * row_vecs + j * tpr, dhb + n * a.dh_out.sn + vi * V);
        }
      }
    }
    cp_async_commit();
  };

  // (1 + scale) of the sample (per-sample modulation: constant over the tile).
  float g1[kVecs][V];
  auto load_g1 = [&](std::int64_t n) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * tpr + tx;
      if (vi >= nvec) continue;
      load_view_vec<V, T>(a.scale, view_offset(a.scale, b, n, static_cast<std::int64_t>(vi) * V),
                          g1[j]);
#pragma unroll
      for (int e = 0; e < V; ++e) g1[j][e] += 1.f;
    }
  };
  // The ring's first rows are requested before anything else, so their DRAM latency overlaps
  // the scale and statistics loads.
#pragma unroll
  for (int p = 0; p < P; ++p) issue(n0 + p, p);
  if (!scale_per_token) load_g1(0);
  float acc_sc[kVecs][V], acc_sh[kVecs][V];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    fill(acc_sc[j], 0.f);
    fill(acc_sh[j], 0.f);
  }
  float mean_next = n0 < n1 ? a.mean[b * a.n + n0] : 0.f;
  float rstd_next = n0 < n1 ? a.rstd[b * a.n + n0] : 0.f;

  int stage = 0;
  int parity = 0;
  for (std::int64_t n = n0; n < n1; ++n, parity ^= 1) {
    const bool first = n == n0;
    const std::int64_t row = b * a.n + n;
    const float mean = mean_next;
    const float rstd = rstd_next;
    if (n + 1 < n1) {
      mean_next = a.mean[row + 1];
      rstd_next = a.rstd[row + 1];
    }
    issue(n + P, stage == 0 ? P : stage - 1);
    cp_async_wait<P>();
    const uint4* cur = mine + stage * streams * row_vecs;
    if (scale_per_token) load_g1(n);

    // Pass 1: sums of dxhat and dxhat * xhat; per-feature gradients.
    float sums[2] = {0.f, 0.f};
    if constexpr (kFast) {
      const float nmr = -mean * rstd;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int vi = j * tpr + tx;
        if (vi >= nvec) continue;
        float x[V], dy[V], xh[V];
        unpack16<T>(cur[j * tpr], x);
        unpack16<T>(cur[row_vecs + j * tpr], dy);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          xh[e] = fmaf(x[e], rstd, nmr);
          const float gy = dy[e] * g1[j][e];
          sums[0] += gy;
          sums[1] = fmaf(gy, xh[e], sums[1]);
          acc_sc[j][e] = fmaf(dy[e], xh[e], acc_sc[j][e]);
          acc_sh[j][e] += dy[e];
        }
        const std::int64_t out = row * a.d + static_cast<std::int64_t>(vi) * V;
        if (a.dscale_tok != nullptr) {
          float dsc[V];
#pragma unroll
          for (int e = 0; e < V; ++e) dsc[e] = dy[e] * xh[e];
          store_any_vec<V, T>(a.dscale_tok, a.scale.f32, out, dsc);
        }
        if (a.dshift_tok != nullptr) store_any_vec<V, T>(a.dshift_tok, a.shift.f32, out, dy);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int vi = j * tpr + tx;
        if (vi >= nvec) continue;
        const std::int64_t d = static_cast<std::int64_t>(vi) * V;
        float x[V], dy[V], w[V], bi[V];
        load_smem_vec<V, T>(cur + j * tpr, x);
        load_smem_vec<V, T>(cur + row_vecs + j * tpr, dy);
        if (gated) {
          float br[V];
          load_smem_vec<V, T>(cur + 2 * row_vecs + j * tpr, br);
          recompute_h_vec<V, T>(a, b, n, d, br, x);
        }
        fill(w, 1.f);
        fill(bi, 0.f);
        if (affine) {
          if (a.weight != nullptr) load_view_vec<V, T>(DevView{a.weight, 0, 0, a.affine_f32}, d, w);
          if (a.bias != nullptr) load_view_vec<V, T>(DevView{a.bias, 0, 0, a.affine_f32}, d, bi);
        }
        float dscale[V], gy[V], dw[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xhat = (x[e] - mean) * rstd;
          gy[e] = dy[e] * g1[j][e];
          const float dxhat = gy[e] * w[e];
          dscale[e] = dy[e] * fmaf(xhat, w[e], bi[e]);
          sums[0] += dxhat;
          sums[1] = fmaf(dxhat, xhat, sums[1]);
          acc_sc[j][e] += dscale[e];
          acc_sh[j][e] += dy[e];
          dw[e] = gy[e] * xhat;
        }
        if (affine && slots.dweight >= 0) accumulate_vec<V>(slot(slots.dweight, d), first, dw);
        if (affine && slots.dbias >= 0) accumulate_vec<V>(slot(slots.dbias, d), first, gy);
        const std::int64_t out = row * a.d + d;
        if (a.dscale_tok != nullptr) store_any_vec<V, T>(a.dscale_tok, a.scale.f32, out, dscale);
        if (a.dshift_tok != nullptr) store_any_vec<V, T>(a.dshift_tok, a.shift.f32, out, dy);
      }
    }
    row_sum<2>(sums, red[parity]);
    const float c1 = a.rms ? 0.f : sums[0] * inv_d;
    const float c2 = sums[1] * inv_d;

    // Pass 2: dx from the thread's own ring chunks (xhat, dxhat recomputed).
    if constexpr (kFast) {
      // dx = rstd (g dy - c1 - xhat c2) with xhat = (x - mean) rstd, as
      // dx = rstd (g dy) + x (-k) + (k mean - c1 rstd), k = c2 rstd^2: three operations per
      // element; the cancellation between the last two terms costs at most log2(|mean| / std)
      // of fp32's 24 bits, far below a 16-bit dx's 8-11.
      const float k = c2 * rstd * rstd;
      const float cx = -k;
      const float c0 = fmaf(k, mean, -c1 * rstd);
      T* const dxr = static_cast<T*>(a.dx) + row * a.d;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int vi = j * tpr + tx;
        if (vi >= nvec) continue;
        float x[V], dy[V], dx[V];
        unpack16<T>(cur[j * tpr], x);
        unpack16<T>(cur[row_vecs + j * tpr], dy);
#pragma unroll
        for (int e = 0; e < V; ++e) dx[e] = fmaf(dy[e] * g1[j][e], rstd, fmaf(x[e], cx, c0));
        store_vec<V>(dxr + vi * V, dx);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int vi = j * tpr + tx;
        if (vi >= nvec) continue;
        const std::int64_t d = static_cast<std::int64_t>(vi) * V;
        const std::int64_t out = row * a.d + d;
        float x[V], dy[V], w[V], br[V], dh[V];
        load_smem_vec<V, T>(cur + j * tpr, x);
        load_smem_vec<V, T>(cur + row_vecs + j * tpr, dy);
        if (gated) {
          load_smem_vec<V, T>(cur + 2 * row_vecs + j * tpr, br);
          recompute_h_vec<V, T>(a, b, n, d, br, x);
        }
        if (has_dh) load_smem_vec<V, T>(cur + 3 * row_vecs + j * tpr, dh);
        fill(w, 1.f);
        if (affine && a.weight != nullptr) {
          load_view_vec<V, T>(DevView{a.weight, 0, 0, a.affine_f32}, d, w);
        }
        float dx[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xhat = (x[e] - mean) * rstd;
          const float dxhat = dy[e] * g1[j][e] * w[e];
          dx[e] = rstd * (dxhat - fmaf(xhat, c2, c1));
        }
        if (gated) {
          gated_dx_vec<V, T>(a, b, n, d, out, first,
                             slots.dgate >= 0 ? slot(slots.dgate, d) : nullptr, br,
                             has_dh ? dh : nullptr, dx);
        }
        store_vec<V>(static_cast<T*>(a.dx) + out, dx);
      }
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();

  // Tile partials [B, tiles, D]: registers for dscale/dshift, own smem slots for the rest.
  const std::int64_t part = static_cast<std::int64_t>(blockIdx.x) * a.d;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = j * tpr + tx;
    if (vi >= nvec) continue;
    const std::int64_t d = static_cast<std::int64_t>(vi) * V;
    if (a.ws_dscale != nullptr) store_vec<V>(a.ws_dscale + part + d, acc_sc[j]);
    if (a.ws_dshift != nullptr) store_vec<V>(a.ws_dshift + part + d, acc_sh[j]);
    float* const ws[3] = {a.ws_dgate, a.ws_dweight, a.ws_dbias};
    const int ids[3] = {slots.dgate, slots.dweight, slots.dbias};
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (kLean || ids[q] < 0) continue;
      float v[V];
      load_vec<V>(slot(ids[q], d), v);
      store_vec<V>(ws[q] + part + d, v);
    }
  }
}

}  // namespace ditscale::kernels::internal
