// CUDA kernel of the layout copies (layout.h): every region copy of a LayoutCopyParams in one
// launch. blockIdx.y selects the copy; threads of the x dimension walk that copy's units in a
// grid-stride loop, consecutive threads on consecutive units of a row (coalesced). A unit is 16
// bytes (uint4 load + store) for copies whose pointers, strides and row size are 16-byte aligned,
// else one element (2, 4 or 8 bytes). Bytes moved: 2 * layout_copy_bytes(p).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/layout.h"

namespace ditscale::kernels {
namespace {

constexpr int kThreads = 256;

// Copies `units` units of type U per row of `c` (strides in elements of elem_bytes, turned into
// units by dividing by `per_unit` elements). I is the index type of the row decomposition:
// 32-bit when the copy is small enough (fewer integer instructions per unit), else 64-bit.
template <typename U, typename I>
__device__ __forceinline__ void copy_units_indexed(const LayoutCopy& c, I batch, I units,
                                                   I per_unit) {
  const I tokens = static_cast<I>(c.tokens), heads = static_cast<I>(c.heads);
  const I total = batch * tokens * heads * units;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  const I sb = static_cast<I>(c.src_stride_b / per_unit),
          st = static_cast<I>(c.src_stride_t / per_unit),
          sh = static_cast<I>(c.src_stride_h / per_unit);
  const I db = static_cast<I>(c.dst_stride_b / per_unit),
          dt = static_cast<I>(c.dst_stride_t / per_unit),
          dh = static_cast<I>(c.dst_stride_h / per_unit);
  const U* src = static_cast<const U*>(c.src);
  U* dst = static_cast<U*>(c.dst);
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const I u = i % units;
    const I row = i / units;
    const I h = row % heads;
    const I bt = row / heads;
    const I t = bt % tokens;
    const I b = bt / tokens;
    dst[b * db + t * dt + h * dh + u] = src[b * sb + t * st + h * sh + u];
  }
}

template <typename U>
__device__ __forceinline__ void copy_units(const LayoutCopy& c, std::int64_t batch,
                                           std::int64_t units, std::int64_t per_unit, bool small) {
  if (small) {
    copy_units_indexed<U, std::uint32_t>(c, static_cast<std::uint32_t>(batch),
                                         static_cast<std::uint32_t>(units),
                                         static_cast<std::uint32_t>(per_unit));
  } else {
    copy_units_indexed<U, std::int64_t>(c, batch, units, per_unit);
  }
}

// E: an unsigned integer type of the element size (general path).
template <typename E>
__global__ void __launch_bounds__(kThreads)
    layout_copy_kernel(const LayoutCopyParams p, std::uint32_t vec_mask, std::uint32_t small_mask) {
  const int i = static_cast<int>(blockIdx.y);
  const LayoutCopy& c = p.copies[i];
  if (c.tokens == 0 || c.heads == 0) return;
  const bool small = (small_mask >> i) & 1u;
  if ((vec_mask >> i) & 1u) {
    constexpr std::int64_t kPerUnit = 16 / sizeof(E);
    copy_units<uint4>(c, p.batch, p.head_dim / kPerUnit, kPerUnit, small);
  } else {
    copy_units<E>(c, p.batch, p.head_dim, 1, small);
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

void layout_copy_cuda(const LayoutCopyParams& p, void* stream) {
  layout_copy_check(p);
  const auto elem = static_cast<std::int64_t>(dtype_size(p.dtype));
  const std::int64_t per_unit = 16 / elem;
  std::uint32_t vec_mask = 0;
  std::uint32_t small_mask = 0;  // copies whose unit indices and unit offsets fit in 32 bits
  std::int64_t max_units = 0;
  for (int i = 0; i < p.num_copies; ++i) {
    const LayoutCopy& c = p.copies[i];
    const bool vec = p.head_dim % per_unit == 0 && aligned16(c.src) && aligned16(c.dst) &&
                     c.src_stride_b % per_unit == 0 && c.src_stride_t % per_unit == 0 &&
                     c.src_stride_h % per_unit == 0 && c.dst_stride_b % per_unit == 0 &&
                     c.dst_stride_t % per_unit == 0 && c.dst_stride_h % per_unit == 0;
    if (vec) vec_mask |= 1u << i;
    const std::int64_t units = vec ? p.head_dim / per_unit : p.head_dim;
    const std::int64_t copy_units = p.batch * c.tokens * c.heads * units;
    max_units = std::max(max_units, copy_units);
    // Largest unit offset touched on either side (+ one grid stride of headroom for the loop
    // index) must stay below 2^32.
    auto extent = [&](std::int64_t sb, std::int64_t st, std::int64_t sh) {
      return ((p.batch - 1) * sb + (c.tokens - 1) * st + (c.heads - 1) * sh) /
                 (vec ? per_unit : 1) +
             units;
    };
    const std::int64_t limit = (std::int64_t{1} << 32) - (std::int64_t{1} << 25);
    if (c.tokens > 0 && c.heads > 0 && copy_units < limit &&
        extent(c.src_stride_b, c.src_stride_t, c.src_stride_h) < limit &&
        extent(c.dst_stride_b, c.dst_stride_t, c.dst_stride_h) < limit) {
      small_mask |= 1u << i;
    }
  }
  if (max_units == 0) return;
  // Enough blocks to cover the largest copy with one unit per thread, capped (grid-stride loop).
  const std::int64_t blocks =
      std::min<std::int64_t>((max_units + kThreads - 1) / kThreads, std::int64_t{1} << 16);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(p.num_copies));
  auto s = static_cast<cudaStream_t>(stream);
  switch (elem) {
    case 2:
      layout_copy_kernel<std::uint16_t><<<grid, kThreads, 0, s>>>(p, vec_mask, small_mask);
      break;
    case 4:
      layout_copy_kernel<std::uint32_t><<<grid, kThreads, 0, s>>>(p, vec_mask, small_mask);
      break;
    case 8:
      layout_copy_kernel<std::uint64_t><<<grid, kThreads, 0, s>>>(p, vec_mask, small_mask);
      break;
    default:
      DS_FAIL("LayoutCopyParams.dtype: unsupported element size ", elem);
  }
  DS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ditscale::kernels
