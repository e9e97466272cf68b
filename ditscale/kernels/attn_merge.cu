// CUDA kernel of the K-way log-sum-exp merge (attn_merge.h).
//
// Work split: one group of G lanes of a warp (G = the power of two >= the row's chunks, at most 32)
// owns one (b, t, h) row of D elements; each lane handles chunks of V elements (V = 16 bytes /
// sizeof(T) on the vectorised path, 1 on the general path) in a strided loop over the row, so a
// group reads whole contiguous rows (coalesced). Every lane reads the K lse values of its row
// (the same addresses for the whole group), computes the weights in fp32 and merges its chunks;
// lane 0 of the group writes the merged lse after a __syncwarp of the group, so an out_lse that
// aliases an input lse is not overwritten before every lane of the row has read it. Rows are spread
// over a grid-stride loop.
//
// Bytes moved: B * T * H * ((K + 1) * D * sizeof(T) + (K + 1) * 4) (see attn_merge.h); no shared
// memory, no atomics, deterministic.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/attn_merge.h"
#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/dispatch.h"
#include "ditscale/kernels/internal/fast_div.h"

namespace ditscale::kernels {
namespace {

using internal::FastDiv;
using internal::from_f;
using internal::load_vec;
using internal::store_vec;
using internal::to_f;

constexpr int kThreads = 256;

template <typename T, int V>
__device__ __forceinline__ void load_chunk(const T* p, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = to_f(p[0]);
  } else {
    load_vec<V>(p, out);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_chunk(T* p, const float (&in)[V]) {
  if constexpr (V == 1) {
    p[0] = from_f<T>(in[0]);
  } else {
    store_vec<V>(p, in);
  }
}

// (b, t, h) of a row index: 32-bit multiply-shift division when the rows fit. A 64-bit division
// is a ~70-instruction subroutine, four per row of 48-96 bytes per lane: this took the bf16
// pairwise merge on the H200 from 40% to 45% of the copy rate (bench/attn_merge_bench).
template <bool kSmall>
__device__ __forceinline__ void row_coords(const AttnMergeParams& p, std::int64_t row,
                                           const FastDiv& div_heads, const FastDiv& div_tokens,
                                           std::int64_t& b, std::int64_t& t, std::int64_t& h) {
  if constexpr (kSmall) {
    const auto r32 = static_cast<std::uint32_t>(row);
    const std::uint32_t bt = div_heads.Div(r32);
    h = r32 - bt * div_heads.d;
    const std::uint32_t b32 = div_tokens.Div(bt);
    t = bt - b32 * div_tokens.d;
    b = b32;
  } else {
    h = row % p.heads;
    const std::int64_t bt = row / p.heads;
    t = bt % p.tokens;
    b = bt / p.tokens;
  }
}

// One row's merge weights: l[i] = input i's lse, m = their max (NaN if any is NaN), sum =
// sum_i exp(l[i] - m), w[i] = exp(l[i] - m) / sum (0 for absent or empty inputs).
__device__ __forceinline__ void row_weights(const AttnMergeParams& p, std::int64_t b,
                                            std::int64_t t, std::int64_t h,
                                            float (&l)[kMaxMergeInputs],
                                            float (&w)[kMaxMergeInputs], float& m, float& sum) {
  const int k = p.num_inputs;
  const float neg_inf = -__int_as_float(0x7f800000);
  m = neg_inf;
  bool any_nan = false;
#pragma unroll
  for (int i = 0; i < kMaxMergeInputs; ++i) {
    if (i < k) {
      const LseView& v = p.in_lse[i];
      // A plain load, not __ldg: out_lse may alias this input.
      l[i] = v.data[b * v.stride_b + t * v.stride_t + h * v.stride_h];
      any_nan = any_nan || isnan(l[i]);
      m = fmaxf(m, l[i]);
    }
  }
  if (any_nan) m = __int_as_float(0x7fc00000);  // NaN propagates (fmaxf would drop it)
  sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxMergeInputs; ++i) {
    w[i] = (i < k && l[i] != neg_inf) ? expf(l[i] - m) : 0.f;
    sum += w[i];
  }
  const float inv = (m == neg_inf) ? 0.f : 1.f / sum;
#pragma unroll
  for (int i = 0; i < kMaxMergeInputs; ++i) w[i] *= inv;
}

// out[b, t, h, :] = sum_i w[i] * in_i[b, t, h, :], this lane's chunks of V elements (every
// `group`-th chunk from lane_in_group).
template <typename T, int V>
__device__ __forceinline__ void merge_row(const AttnMergeParams& p, std::int64_t b, std::int64_t t,
                                          std::int64_t h, const float (&l)[kMaxMergeInputs],
                                          const float (&w)[kMaxMergeInputs], int lane_in_group,
                                          int group, std::int64_t chunks) {
  const int k = p.num_inputs;
  const float neg_inf = -__int_as_float(0x7f800000);
  T* out_row =
      static_cast<T*>(p.out.data) + b * p.out.stride_b + t * p.out.stride_t + h * p.out.stride_h;
  for (std::int64_t c = lane_in_group; c < chunks; c += group) {
    const std::int64_t d = c * V;
    float acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxMergeInputs; ++i) {
      if (i < k && l[i] != neg_inf) {  // empty blocks are never read
        const AttnOutView& v = p.in[i];
        const T* src =
            static_cast<const T*>(v.data) + b * v.stride_b + t * v.stride_t + h * v.stride_h + d;
        float x[V];
        load_chunk<T, V>(src, x);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = fmaf(w[i], x[e], acc[e]);
      }
    }
    store_chunk<T, V>(out_row + d, acc);
  }
}

// `group` lanes per row (power of two <= 32); `chunks` = ceil(D / V) chunks per row.
template <typename T, int V, bool kSmall>
__global__ void __launch_bounds__(kThreads)
    attn_merge_kernel(const AttnMergeParams p, int group, std::int64_t chunks, FastDiv div_heads,
                      FastDiv div_tokens) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int lane_in_group = lane & (group - 1);
  const unsigned group_mask = (group == 32 ? 0xffffffffu : ((1u << group) - 1u))
                              << (lane & ~(group - 1));
  const std::int64_t rows = p.batch * p.tokens * p.heads;
  const std::int64_t groups_per_grid = static_cast<std::int64_t>(gridDim.x) * blockDim.x / group;
  const float neg_inf = -__int_as_float(0x7f800000);
  for (std::int64_t row =
           (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
       row < rows; row += groups_per_grid) {
    std::int64_t h, t, b;
    row_coords<kSmall>(p, row, div_heads, div_tokens, b, t, h);
    float l[kMaxMergeInputs];
    float w[kMaxMergeInputs];
    float m, sum;
    row_weights(p, b, t, h, l, w, m, sum);
    merge_row<T, V>(p, b, t, h, l, w, lane_in_group, group, chunks);
    if (p.out_lse.data != nullptr) {
      __syncwarp(group_mask);  // every lane of the row has read in_lse (out_lse may alias it)
      if (lane_in_group == 0) {
        p.out_lse.data[b * p.out_lse.stride_b + t * p.out_lse.stride_t + h * p.out_lse.stride_h] =
            (m == neg_inf) ? neg_inf : m + logf(sum);
      }
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15u) == 0; }

bool strides_ok(std::int64_t sb, std::int64_t st, std::int64_t sh, std::int64_t v) {
  return sb % v == 0 && st % v == 0 && sh % v == 0;
}

}  // namespace

void attn_merge_cuda(const AttnMergeParams& p, void* stream) {
  attn_merge_check(p, /*for_gpu=*/true);
  const std::int64_t rows = p.batch * p.tokens * p.heads;
  if (rows == 0) return;
  const auto vec = static_cast<std::int64_t>(16 / dtype_size(p.dtype));
  bool vectorised = p.head_dim % vec == 0 && aligned16(p.out.data) &&
                    strides_ok(p.out.stride_b, p.out.stride_t, p.out.stride_h, vec);
  for (int i = 0; i < p.num_inputs && vectorised; ++i) {
    vectorised = aligned16(p.in[i].data) &&
                 strides_ok(p.in[i].stride_b, p.in[i].stride_t, p.in[i].stride_h, vec);
  }
  const std::int64_t chunks = vectorised ? p.head_dim / vec : p.head_dim;
  int group = 1;
  while (group < 32 && group < chunks) group *= 2;
  const std::int64_t threads_needed = rows * group;
  const std::int64_t blocks =
      std::min<std::int64_t>((threads_needed + kThreads - 1) / kThreads, std::int64_t{1} << 20);
  auto s = static_cast<cudaStream_t>(stream);
  const bool small = rows < (std::int64_t{1} << 31);
  const FastDiv dh = FastDiv::Make(small ? static_cast<std::uint32_t>(p.heads) : 1u);
  const FastDiv dt = FastDiv::Make(small ? static_cast<std::uint32_t>(p.tokens) : 1u);
  internal::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    internal::dispatch_bool(small, [&](auto small_tag) {
      constexpr bool kSmall = decltype(small_tag)::value;
      if (vectorised) {
        attn_merge_kernel<T, kVec, kSmall>
            <<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(p, group, chunks, dh, dt);
      } else {
        attn_merge_kernel<T, 1, kSmall>
            <<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(p, group, chunks, dh, dt);
      }
    });
  });
  DS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ditscale::kernels
