// AdaLN forward with one warp per row, the row held in registers. Included by adaln.cu only.
//
// Why: for rows of at most 256 16-byte vectors (D <= 2048 in bf16/fp16, 1024 in fp32) the
// bulk-copy kernel (adaln_fwd_tma.cuh) stays at 57-77% of the copy bandwidth on the H200: its
// blocks pay a mbarrier wait, two block barriers and a bulk-copy issue per 2-3 KB row, and the
// register budget leaves ~7 blocks (rows) per SM. Here a warp owns a row (kRows rows) from load
// to store: no shared memory, no block barrier, the reductions are warp shuffles only, so the
// SM holds as many rows in flight as warps fit (up to 32-64), like a plain copy kernel does.
//
// Coefficients (kAhead > 0, the default where it applies: scale and shift in T, no affine): the
// row's scale and shift vectors are loaded packed (16 bytes each, as stored) kAhead vectors ahead
// of the one being written, the first kAhead right after the row's x loads (before its reduction).
// Loaded as each vector is written (kAhead == 0, the general form: fp32 modulation, affine),
// every coefficient load waits behind the row's previous stores (the compiler may not move a load
// above a store that could alias it): on the H200 that alone held 3 KB rows to ~72-80% of the
// copy bandwidth (bench/adaln_probe, adaln-kernel-notes.md v6). kAhead = 2 for modulation per
// sample (L1-resident: two vectors ahead hide its latency with the fewest registers), kVecs
// (all, with the x loads) per token, where every row's coefficients come from DRAM. Packed
// coefficients take plain loads and stores (no streaming hints: they measured 1-6 points slower
// there, and a runtime choice in this loop costs instructions too).
//
// Rows: with packed coefficients the grid is (blocks of 4 tokens, samples) and warp w of column
// b takes token w of sample b, then w + (grid warps), ... (no division per row: the per-row
// integer divisions and setup were ~10% of the instructions of a one-row warp). Otherwise warp w
// takes rows w * kRows ... w * kRows + kRows - 1 of the flattened [B * N] rows, then
// w + (grid warps), ... Either way the launcher sizes the grid to cover all rows in one pass
// unless AdaLNTuning::max_resident_blocks caps it, or, with kPrefetch, to one wave of resident
// blocks.
// Lane l owns the 16-byte vectors j * 32 + l, j < kVecs, of each of its rows, loaded all at once
// (every load of a row group is issued before the first reduction). Statistics: two-pass (mean,
// then the centred sum of squares from the registers), fp32, warp shuffles in a fixed order: the
// bits depend on the inputs only. Plain (not gated) calls, 16-byte aligned views, rows < 2^31
// (checked by the launcher).
#pragma once

#include <cstdint>

#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_plan.h"

namespace ditscale::kernels::internal {

// Warps (rows) per block of the warp-per-row forward.
inline constexpr int kFwdWarpsPerBlock = 4;
// Most vectors per lane it takes: kFwdWarpMaxVecs (adaln_plan.h).

// Minimum resident blocks for __launch_bounds__ (registers <= 65536 / (128 x blocks)): ptxas
// keeps ~6 registers per 16-byte vector a lane holds (the row data, then the coefficient loads it
// hoists ahead of the stores) plus ~56; at a 64-register cap it spilled from 4 vectors, at 80 from
// 6. Blocks of 4 warps keep the caps fine-grained (8 blocks: 64 registers, 5: 102, 4: 128).
constexpr int fwd_warp_min_blocks(int vecs_per_lane) {
  const int blocks = 512 / (6 * vecs_per_lane + 56);
  return blocks < 1 ? 1 : (blocks > 8 ? 8 : blocks);
}

// The packed scale and shift vectors vi of row (b, n): 16 bytes each, zeros past the row.
template <typename T>
__device__ __forceinline__ void fwd_warp_coef(const T* sc_row, const T* sh_row, int vi, int nvec,
                                              uint4& sc, uint4& sh) {
  constexpr int V = 16 / sizeof(T);
  if (vi < nvec) {
    sc = *reinterpret_cast<const uint4*>(sc_row + static_cast<std::int64_t>(vi) * V);
    sh = *reinterpret_cast<const uint4*>(sh_row + static_cast<std::int64_t>(vi) * V);
  } else {
    sc = make_uint4(0u, 0u, 0u, 0u);
    sh = sc;
  }
}

// A row of x as a warp sees it: sample b, token n; ok false for the padding rows past the end
// (their loads read zeros, nothing is written).
struct WarpRow {
  unsigned b = 0, n = 0;
  bool ok = false;
};

// Rows u0 ... u0 + kRows - 1 of the flattened [B * N] rows (one division per row).
template <int kRows>
__device__ __forceinline__ void fwd_warp_rows_at(const FwdArgs& a, unsigned long long u0,
                                                 WarpRow (&pos)[kRows]) {
  const unsigned seq = static_cast<unsigned>(a.n);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    pos[r].ok = u0 + r < static_cast<unsigned long long>(a.rows);
    const unsigned u = pos[r].ok ? static_cast<unsigned>(u0 + r) : 0u;
    pos[r].b = u / seq;
    pos[r].n = u - pos[r].b * seq;
  }
}

// Loads rows pos of x into raw (zeros for rows that are not ok and lanes past the row); kHints:
// streaming loads where a.evict_first asks for them.
template <typename T, int kVecs, int kRows, bool kHints>
__device__ __forceinline__ void fwd_warp_load(const FwdArgs& a, const WarpRow (&pos)[kRows],
                                              int lane, int nvec, uint4 (&raw)[kRows][kVecs]) {
  const T* const xg = static_cast<const T*>(a.x.data);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const uint4* src =
        reinterpret_cast<const uint4*>(xg + static_cast<std::int64_t>(pos[r].b) * a.x.sb +
                                       static_cast<std::int64_t>(pos[r].n) * a.x.sn);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * 32 + lane;
      if (pos[r].ok && vi < nvec) {
        raw[r][j] = kHints && a.evict_first ? __ldcs(src + vi) : src[vi];
      } else {
        raw[r][j] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// Statistics and output of rows pos held in raw; coefficients kAhead vectors ahead (packed) or
// at use (kAhead == 0).
template <typename T, int kVecs, int kRows, int kAhead>
__device__ __forceinline__ void fwd_warp_rows(const FwdArgs& a, const WarpRow (&pos)[kRows],
                                              int lane, int nvec,
                                              const uint4 (&raw)[kRows][kVecs]) {
  constexpr int V = 16 / sizeof(T);
  // Packed coefficients with 16-bit x: the normalisation folded into the modulation.
  constexpr bool kFold = kAhead > 0 && sizeof(T) == 2;
  const unsigned seq = static_cast<unsigned>(a.n);
  T* const yg = static_cast<T*>(a.y);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const unsigned b = pos[r].b;
    const unsigned n = pos[r].n;
    // Packed coefficients: the first kAhead vectors now, with the row's x loads in flight.
    uint4 csc[kVecs], csh[kVecs];
    const T* sc_row = nullptr;
    const T* sh_row = nullptr;
    if constexpr (kAhead > 0) {
      sc_row = static_cast<const T*>(a.scale.data) + view_offset(a.scale, b, n, 0);
      sh_row = static_cast<const T*>(a.shift.data) + view_offset(a.shift, b, n, 0);
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        fwd_warp_coef<T>(sc_row, sh_row, j * 32 + lane, nvec, csc[j], csh[j]);
      }
    }
    float mean = 0.f;
    if (!a.rms) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        float v[V];
        unpack_vec<V, T>(raw[r][j], v);
#pragma unroll
        for (int e = 0; e < V; ++e) s += v[e];
      }
      mean = warp_sum(s) * a.inv_d;
    }
    float q = 0.f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * 32 + lane < nvec) {
        float v[V];
        unpack_vec<V, T>(raw[r][j], v);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float c = v[e] - mean;
          q = fmaf(c, c, q);
        }
      }
    }
    const float rstd = rsqrtf(warp_sum(q) * a.inv_d + a.eps);
    if (!pos[r].ok) continue;        // warp-uniform
    const unsigned u = b * seq + n;  // y, mean and rstd are contiguous [B * N] rows
    if (lane == 0 && a.mean != nullptr) {
      a.mean[u] = mean;
      a.rstd[u] = rstd;
    }
    uint4* const dst = reinterpret_cast<uint4*>(yg + static_cast<std::int64_t>(u) * a.d);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * 32 + lane;
      if (vi >= nvec) continue;
      float v[V], ca[V], cc[V];
      unpack_vec<V, T>(raw[r][j], v);
      if constexpr (kAhead > 0) {
        unpack_vec<V, T>(csc[j], ca);
        unpack_vec<V, T>(csh[j], cc);
        if constexpr (kFold) {
          // y = x * A + C, A = rstd * (1 + scale), C = shift - mean * A: three FMAs per element
          // where the plain form takes four (-4.5% instructions; measured no time change on the
          // H200, adaln-kernel-notes.md v7); the cancellation in C costs at most
          // log2(|mean| / std) of fp32's 24 bits, far below 16-bit outputs' 8-11.
#pragma unroll
          for (int e = 0; e < V; ++e) {
            ca[e] = fmaf(rstd, ca[e], rstd);
            cc[e] = fmaf(-mean, ca[e], cc[e]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) ca[e] += 1.f;
        }
        if (j + kAhead < kVecs) {
          fwd_warp_coef<T>(sc_row, sh_row, (j + kAhead) * 32 + lane, nvec, csc[j + kAhead],
                           csh[j + kAhead]);
        }
      } else {
        fwd_coefs<V, T>(a, b, n, static_cast<std::int64_t>(vi) * V, ca, cc);
      }
      uint4 out;
      T* o = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        o[e] =
            from_f<T>(kFold ? fmaf(v[e], ca[e], cc[e]) : fmaf((v[e] - mean) * rstd, ca[e], cc[e]));
      }
      if (kAhead == 0 && a.evict_first) {  // packed coefficients: never (see the top)
        __stcs(dst + vi, out);
      } else {
        dst[vi] = out;
      }
    }
  }
}

// kAhead: see the top of this file (kAhead > 2 holds every coefficient vector of the row: the
// register budget counts them as x vectors).
// kPrefetch: the loads of the warp's next row group are issued before the current group is
// reduced and written (register double buffer), so a warp always has a row in flight; meant for
// a persistent grid (each warp walks many groups), sized by the launcher.
template <typename T, int kVecs, int kRows, bool kPrefetch, int kAhead>
__global__ void __launch_bounds__(32 * kFwdWarpsPerBlock,
                                  fwd_warp_min_blocks(kVecs* kRows*(kPrefetch ? 2 : 1) *
                                                      (kAhead > 2 ? 2 : 1)))
    adaln_fwd_warp_kernel(const FwdArgs a) {
  pdl_enter();  // before any global access (adaln_device.cuh)
  const int lane = static_cast<int>(threadIdx.x);
  const int nvec = static_cast<int>(a.d / (16 / sizeof(T)));
  uint4 raw[kRows][kVecs];
  WarpRow pos[kRows];
  if constexpr (kAhead > 0) {
    // Packed coefficients (one row per warp, no prefetch): grid (row blocks of a sample,
    // samples), so a warp knows its sample and token without a division; both strided for the
    // grids the launcher caps.
    static_assert(kRows == 1 && !kPrefetch, "packed coefficients: one row per warp");
    const unsigned seq = static_cast<unsigned>(a.n);
    const unsigned batch = static_cast<unsigned>(a.batch);
    const unsigned stride = gridDim.x * blockDim.y;
    for (unsigned b = blockIdx.y; b < batch; b += gridDim.y) {
      for (unsigned n = blockIdx.x * blockDim.y + threadIdx.y; n < seq; n += stride) {
        pos[0] = WarpRow{b, n, true};
        fwd_warp_load<T, kVecs, kRows, false>(a, pos, lane, nvec, raw);
        fwd_warp_rows<T, kVecs, kRows, kAhead>(a, pos, lane, nvec, raw);
      }
    }
  } else {
    const unsigned long long rows = static_cast<unsigned long long>(a.rows);
    const unsigned warps = gridDim.x * blockDim.y;
    unsigned long long g = blockIdx.x * blockDim.y + threadIdx.y;
    if constexpr (kPrefetch) {
      if (g * kRows < rows) {
        fwd_warp_rows_at<kRows>(a, g * kRows, pos);
        fwd_warp_load<T, kVecs, kRows, true>(a, pos, lane, nvec, raw);
      }
    }
    for (; g * kRows < rows; g += warps) {
      if constexpr (kPrefetch) {
        uint4 next[kRows][kVecs];
        WarpRow next_pos[kRows];
        fwd_warp_rows_at<kRows>(a, (g + warps) * kRows, next_pos);
        fwd_warp_load<T, kVecs, kRows, true>(a, next_pos, lane, nvec, next);
        fwd_warp_rows<T, kVecs, kRows, 0>(a, pos, lane, nvec, raw);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          pos[r] = next_pos[r];
#pragma unroll
          for (int j = 0; j < kVecs; ++j) raw[r][j] = next[r][j];
        }
      } else {
        fwd_warp_rows_at<kRows>(a, g * kRows, pos);
        fwd_warp_load<T, kVecs, kRows, true>(a, pos, lane, nvec, raw);
        fwd_warp_rows<T, kVecs, kRows, 0>(a, pos, lane, nvec, raw);
      }
    }
  }
}

}  // namespace ditscale::kernels::internal
