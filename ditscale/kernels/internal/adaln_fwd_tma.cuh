// Hopper (sm_90) AdaLN forward kernel with the bulk copy engine. Included by adaln.cu only.
//
// Why: the cp.async kernel (adaln_fwd_pipe.cuh) reached 77% of the copy bandwidth on the H200 with
// every thread issuing its own 16-byte loads and stores. Here one thread per block moves whole
// rows: a 1D bulk copy (cp.async.bulk, global -> shared, completing on an mbarrier with expect_tx)
// loads row u + P while row u is reduced, and (kBulkStore) y is written back into the row's own
// ring slot and leaves with one bulk store (shared -> global, bulk_group), so the write stream is
// asynchronous too and the SM's load/store unit only sees shared-memory traffic.
//
// Block: one row at a time, blockDim = tpr, a multiple of 32; thread t owns the 16-byte vectors
// j * tpr + t, j < kVecs, of the row. Persistent grid: block k takes rows k, k + grid, ...
// Dynamic shared memory: kStages ring slots of D * sizeof(T) bytes (16-byte multiple). (Groups
// of 2 or 4 rows per slot measured slower, adaln-kernel-notes.md v4, and were removed.)
// Ring protocol (thread 0 issues every bulk operation of its block):
//   - iteration i waits on full[i % kStages] with parity (i / kStages) & 1;
//   - loads run P rows ahead: P = kStages - 1 (plain stores) or kStages - 2 (bulk stores, since a
//     slot is refilled only after the bulk store of its previous row has read it:
//     cp.async.bulk.wait_group.read 1 by the same thread, before the refill);
//   - every thread has read its chunks of a slot before the first barrier of that row, and the
//     refill of a slot is issued at least one iteration later (after that barrier);
//   - y chunks are written by their owners, then fence.proxy.async + a barrier, then the store.
// Coefficients: y = xhat * A + C with A = w (1 + scale), C = b (1 + scale) + shift, either kept in
// registers across rows of one sample (kCoefReload false) or recomputed from the (L1-resident)
// modulation for every row (kCoefReload true: fewer registers, more resident blocks for wide
// rows). Other architectures compile an empty body; the launcher checks the binary version.
#pragma once

#include <cstdint>

#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_plan.h"

namespace ditscale::kernels::internal {

// Block size cap: fwd_tma_max_threads (adaln_plan.h).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ std::uint64_t evict_first_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// Global -> shared bulk copy of `bytes` (16-byte multiple, both ends 16-byte aligned).
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes,
                                          unsigned bar, bool hint, std::uint64_t policy) {
  if (hint) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
  }
}
// Shared -> global bulk copy, one bulk group per call.
__device__ __forceinline__ void bulk_store(void* dst, unsigned src, unsigned bytes, bool hint,
                                           std::uint64_t policy) {
  if (hint) {
    asm volatile(
        "cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;\n" ::"l"(
            dst),
        "r"(src), "r"(bytes), "l"(policy)
        : "memory");
  } else {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(src), "r"(bytes)
                 : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most kPending of this thread's bulk store groups still read shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif

// float[V] -> V elements of T packed into one 16-byte shared-memory chunk.
template <int V, typename T>
__device__ __forceinline__ void store_smem_vec(uint4* p, const float (&in)[V]) {
  static_assert(V * sizeof(T) == 16, "one 16-byte chunk per vector");
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < V; ++i) e[i] = from_f<T>(in[i]);
  *p = raw;
}

// Not gated (the launcher sends gated calls to the cp.async kernel). rows < 2^31.
// One row per block iteration: a ring slot holds the row, loaded with one bulk copy and
// (kBulkStore) stored with one bulk copy.
template <typename T, int kVecs, int kStages, bool kBulkStore, bool kCoefReload>
__global__ void __launch_bounds__(fwd_tma_max_threads(kVecs * 16 / sizeof(T), kCoefReload), 1)
    adaln_fwd_tma_kernel(const FwdArgs a) {
  pdl_enter();  // before any global access (adaln_device.cuh)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int V = 16 / sizeof(T);
  constexpr int P = kBulkStore ? kStages - 2 : kStages - 1;
  static_assert(P >= 1, "ring too shallow");
  extern __shared__ __align__(128) uint4 tma_ring[];
  __shared__ float red[2][32];
  __shared__ __align__(8) std::uint64_t full[kStages];
  const int tpr = blockDim.x;
  const int tx = threadIdx.x;
  const int nvec = static_cast<int>(a.d / V);
  const unsigned row_bytes = static_cast<unsigned>(nvec) * 16u;
  const unsigned rows = static_cast<unsigned>(a.rows);
  const unsigned seq = static_cast<unsigned>(a.n);
  const float inv_d = 1.0f / static_cast<float>(a.d);
  const bool per_token = a.scale.sn != 0 || a.shift.sn != 0;
  const bool issuer = tx == 0;
  const T* const xg = static_cast<const T*>(a.x.data);
  T* const yg = static_cast<T*>(a.y);
  const std::uint64_t policy = a.evict_first ? evict_first_policy() : 0;
  const unsigned step = gridDim.x;

  if (issuer) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) mbar_init(smem_u32(&full[s]), 1);
    mbar_init_fence();
  }
  __syncthreads();

  auto row_src = [&](unsigned u) {
    const unsigned b = u / seq;
    const unsigned n = u - b * seq;
    return xg + b * a.x.sb + n * a.x.sn;
  };
  // Thread 0: starts the bulk load of row u into ring slot `stage`.
  auto issue = [&](unsigned u, int stage) {
    if (u >= rows) return;
    const unsigned bar = smem_u32(&full[stage]);
    mbar_expect_tx(bar, row_bytes);
    bulk_load(smem_u32(tma_ring + stage * nvec), row_src(u), row_bytes, bar, a.evict_first, policy);
  };
  if (issuer) {
#pragma unroll
    for (int p = 0; p < P; ++p) issue(blockIdx.x + p * step, p);
  }

  float coef_a[kCoefReload ? 1 : kVecs][V], coef_c[kCoefReload ? 1 : kVecs][V];
  long long cached_b = -1;
  int stage = 0;
  unsigned phase = 0;
  unsigned parity = 0;  // alternates the RMS reduction buffer (no barrier between its uses)
  for (unsigned u = blockIdx.x; u < rows; u += step) {
    if (issuer) {
      if constexpr (kBulkStore) bulk_wait_read<kStages - P - 1>();  // slot's last store has read
      const int next = stage + P >= kStages ? stage + P - kStages : stage + P;
      issue(u + P * step, next);
    }
    mbar_wait(smem_u32(&full[stage]), phase);
    uint4* const cur = tma_ring + stage * nvec;

    float v[kVecs][V];
    float s[1] = {0.f};
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * tpr + tx;
      if (vi < nvec) {
        load_smem_vec<V, T>(cur + vi, v[j]);
      } else {
        fill(v[j], 0.f);
      }
#pragma unroll
      for (int e = 0; e < V; ++e) s[0] += v[j][e];
    }
    float mean = 0.f;
    if (!a.rms) {
      row_sum<1>(s, red[0]);
      mean = s[0] * inv_d;
    }
    float q[1] = {0.f};
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * tpr + tx < nvec) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float c = v[j][e] - mean;
          q[0] = fmaf(c, c, q[0]);
        }
      }
    }
    row_sum<1>(q, red[a.rms ? parity : 1u]);
    parity ^= 1u;
    const float rstd = rsqrtf(q[0] * inv_d + a.eps);
    const unsigned b = u / seq;
    const unsigned n = u - b * seq;
    if constexpr (!kCoefReload) {
      if (per_token || b != cached_b) {
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int vi = j * tpr + tx;
          if (vi < nvec) {
            fwd_coefs<V, T>(a, b, n, static_cast<std::int64_t>(vi) * V, coef_a[j], coef_c[j]);
          }
        }
        cached_b = b;
      }
    }
    if (tx == 0 && a.mean != nullptr) {
      a.mean[u] = mean;
      a.rstd[u] = rstd;
    }
    T* const yrow = yg + static_cast<std::int64_t>(u) * a.d;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = j * tpr + tx;
      if (vi >= nvec) continue;
      float out[V];
      if constexpr (kCoefReload) {
        float ca[V], cc[V];
        fwd_coefs<V, T>(a, b, n, static_cast<std::int64_t>(vi) * V, ca, cc);
#pragma unroll
        for (int e = 0; e < V; ++e) out[e] = fmaf((v[j][e] - mean) * rstd, ca[e], cc[e]);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          out[e] = fmaf((v[j][e] - mean) * rstd, coef_a[j][e], coef_c[j][e]);
        }
      }
      if constexpr (kBulkStore) {
        store_smem_vec<V, T>(cur + vi, out);
      } else {
        store_vec<V>(yrow + static_cast<std::int64_t>(vi) * V, out);
      }
    }
    if constexpr (kBulkStore) {
      fence_proxy_async_smem();  // this thread's y chunks -> visible to the bulk copy
      __syncthreads();
      if (issuer) {
        bulk_store(yrow, smem_u32(tma_ring + stage * nvec), row_bytes, a.evict_first, policy);
      }
    }
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  if constexpr (kBulkStore) {
    if (issuer) bulk_wait_read<0>();  // shared memory must outlive the last store's read
  }
#endif
}

}  // namespace ditscale::kernels::internal
