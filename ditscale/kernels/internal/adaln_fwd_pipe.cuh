// Pipelined, persistent AdaLN forward kernel (vector path). Included by adaln.cu only.
//
// Why: one block per row that loads, reduces and stores with nothing overlapping keeps only a
// few rows' loads in flight per SM (registers cap the resident blocks), so the first kernel ran at
// half the copy bandwidth. Here a grid sized to the resident capacity walks groups of rows
// (grid-stride), and every thread streams the 16-byte chunks of rows it will own kStages - 1 rows
// ahead into a shared-memory ring with cp.async (see adaln_device.cuh): the loads of the next
// rows are in flight while the current row is reduced and stored. Per-sample modulation and the
// affine are folded into two per-feature coefficients kept in registers across rows of the same
// sample (y = xhat * A + C with A = w (1 + scale), C = b (1 + scale) + shift); per-token
// modulation is loaded per row before the reductions, so its latency overlaps them.
//
// Block: blockDim.x = tpr threads per row (multiple of 32), blockDim.y = R rows per group; thread
// t owns feature vectors j * tpr + t, j < kVecs (consecutive threads read consecutive 16 bytes).
// Dynamic shared memory: kStages * streams * R * tpr * kVecs 16-byte chunks (streams: 1 plain,
// 2 gated: residual and branch). Statistics: mean, then the centred variance from registers.
#pragma once

#include <cstdint>

#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_plan.h"

namespace ditscale::kernels::internal {

// Block size cap: fwd_pipe_max_threads (adaln_plan.h).

// kRows: rows each thread carries per iteration (1 or 2). Two rows share the coefficient
// registers and one barrier per reduction, which halves the per-row fixed cost (barriers, index
// math) and fits more rows in flight per SM than a second resident block would.
template <typename T, int kVecs, int kStages, int kRows>
__global__ void __launch_bounds__(fwd_pipe_max_threads(kVecs * 16 / sizeof(T), kRows), 1)
    adaln_fwd_pipe_kernel(const FwdArgs a, const std::int64_t num_items) {
  pdl_enter();  // before any global access (adaln_device.cuh)
  constexpr int V = 16 / sizeof(T);
  constexpr int P = kStages - 1;  // items in flight ahead of the current one
  extern __shared__ uint4 fwd_ring[];
  __shared__ float red[2][32 * kRows];
  const int tpr = blockDim.x;
  const int rows_per_group = blockDim.y;
  const int tx = threadIdx.x;
  const int nvec = static_cast<int>(a.d / V);
  const int row_vecs = tpr * kVecs;
  const int streams = a.gated ? 2 : 1;
  const int slot_stride = rows_per_group * row_vecs;  // one (row i, stream) slot of a stage
  uint4* const mine = fwd_ring + threadIdx.y * row_vecs + tx;
  const T* const src0 = static_cast<const T*>(a.x.data);  // x, or residual when gated
  const T* const src1 = static_cast<const T*>(a.branch.data);
  const float inv_d = 1.0f / static_cast<float>(a.d);
  const unsigned rows = static_cast<unsigned>(a.rows);  // < 2^31 (checked by the launcher)
  const unsigned seq = static_cast<unsigned>(a.n);
  const bool per_token = a.scale.sn != 0 || a.shift.sn != 0;
  // Row i of item u for this thread: group u * kRows + i, row threadIdx.y of that group.
  auto row_of = [&](std::int64_t u, int i) {
    return static_cast<unsigned>((u * kRows + i) * rows_per_group + threadIdx.y);
  };

  // Copies the rows of item u into ring stage `stage`; always commits one copy group.
  auto issue = [&](std::int64_t u, int stage) {
    if (u < num_items) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const unsigned row = row_of(u, i);
        if (row >= rows) continue;
        const unsigned b = row / seq;
        const unsigned n = row - b * seq;
        uint4* dst = mine + (stage * kRows + i) * streams * slot_stride;
        const T* p0 = src0 + b * a.x.sb + n * a.x.sn;
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int vi = j * tpr + tx;
          if (vi < nvec) cp_async16(dst + j * tpr, p0 + vi * V);
        }
        if (a.gated) {
          const T* p1 = src1 + b * a.branch.sb + n * a.branch.sn;
#pragma unroll
          for (int j = 0; j < kVecs; ++j) {
            const int vi = j * tpr + tx;
            if (vi < nvec) cp_async16(dst + slot_stride + j * tpr, p1 + vi * V);
          }
        }
      }
    }
    cp_async_commit();
  };

  // y = xhat * A + C per feature; reloaded when the sample changes (every row if per token).
  float coef_a[kVecs][V], coef_c[kVecs][V];
  long long cached_b = -1;
  auto load_coefs = [&](std::int64_t b, std::int64_t n) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * tpr + tx;
      if (vi >= nvec) continue;
      const std::int64_t d = static_cast<std::int64_t>(vi) * V;
      load_view_vec<V, T>(a.scale, view_offset(a.scale, b, n, d), coef_a[j]);
      load_view_vec<V, T>(a.shift, view_offset(a.shift, b, n, d), coef_c[j]);
#pragma unroll
      for (int e = 0; e < V; ++e) coef_a[j][e] += 1.f;
    }
    if (a.weight == nullptr && a.bias == nullptr) return;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * tpr + tx;
      if (vi >= nvec) continue;
      const std::int64_t d = static_cast<std::int64_t>(vi) * V;
      float w[V], bi[V];
      fill(w, 1.f);
      fill(bi, 0.f);
      if (a.weight != nullptr) load_view_vec<V, T>(DevView{a.weight, 0, 0, a.affine_f32}, d, w);
      if (a.bias != nullptr) load_view_vec<V, T>(DevView{a.bias, 0, 0, a.affine_f32}, d, bi);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        coef_c[j][e] = fmaf(bi[e], coef_a[j][e], coef_c[j][e]);
        coef_a[j][e] *= w[e];
      }
    }
  };

  const std::int64_t step = gridDim.x;
#pragma unroll
  for (int p = 0; p < P; ++p) issue(blockIdx.x + p * step, p);

  int stage = 0;
  for (std::int64_t u = blockIdx.x; u < num_items; u += step) {
    issue(u + P * step, stage == 0 ? P : stage - 1);  // stage of the item P ahead
    cp_async_wait<P>();                               // this item's own chunks have landed

    float v[kRows][kVecs][V];
    float s[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const unsigned row = row_of(u, i);
      const bool row_ok = row < rows;
      const unsigned b = row_ok ? row / seq : 0;
      const unsigned n = row_ok ? row - b * seq : 0;
      const uint4* cur = mine + (stage * kRows + i) * streams * slot_stride;
      s[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int vi = j * tpr + tx;
        if (row_ok && vi < nvec) {
          load_smem_vec<V, T>(cur + j * tpr, v[i][j]);
          if (a.gated) {
            const std::int64_t d = static_cast<std::int64_t>(vi) * V;
            float br[V], gt[V];
            load_smem_vec<V, T>(cur + slot_stride + j * tpr, br);
            load_view_vec<V, T>(a.gate, view_offset(a.gate, b, n, d), gt);
#pragma unroll
            for (int e = 0; e < V; ++e) v[i][j][e] = gated_h<T>(v[i][j][e], gt[e], br[e]);
            store_vec<V>(static_cast<T*>(a.h) + static_cast<std::int64_t>(row) * a.d + d, v[i][j]);
          }
        } else {
          fill(v[i][j], 0.f);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) s[i] += v[i][j][e];
      }
    }

    float mean[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) mean[i] = 0.f;
    if (!a.rms) {
      row_sum<kRows>(s, red[0]);
#pragma unroll
      for (int i = 0; i < kRows; ++i) mean[i] = s[i] * inv_d;
    }
    float q[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      q[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (j * tpr + tx < nvec) {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const float c = v[i][j][e] - mean[i];
            q[i] = fmaf(c, c, q[i]);
          }
        }
      }
    }
    row_sum<kRows>(q, red[1]);

#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const unsigned row = row_of(u, i);
      if (row >= rows) continue;
      const float rstd = rsqrtf(q[i] * inv_d + a.eps);
      const unsigned b = row / seq;
      if (per_token || b != cached_b) {
        load_coefs(b, row - b * seq);
        cached_b = b;
      }
      if (tx == 0 && a.mean != nullptr) {
        a.mean[row] = mean[i];
        a.rstd[row] = rstd;
      }
      T* y = static_cast<T*>(a.y) + static_cast<std::int64_t>(row) * a.d;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int vi = j * tpr + tx;
        if (vi >= nvec) continue;
        float out[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          out[e] = fmaf((v[i][j][e] - mean[i]) * rstd, coef_a[j][e], coef_c[j][e]);
        }
        store_vec<V>(y + static_cast<std::int64_t>(vi) * V, out);
      }
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();
}

}  // namespace ditscale::kernels::internal
