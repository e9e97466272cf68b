// CUDA kernel of the rotary embedding (rotary.h). One block per row (b, s) of H * Dh elements
// (a grid-stride loop over rows past the grid's size); its threads walk the row's H * Dh / 2
// pairs, consecutive threads on consecutive pairs (2-element loads and stores, coalesced within
// a head; x's heads may be strided). The
// pair's cos / sin come from the row's [Dh] frequencies, shared by its H heads (cached). The
// products and sums use the round-to-nearest intrinsics, so nvcc cannot contract them into fused
// multiply-adds: the bits of the CPU implementation and of diffusers' formula.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/rotary.h"

namespace ditscale::kernels {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 1 << 20;

template <typename T>
struct Pair;
template <>
struct Pair<float> {
  using V = float2;
  __device__ static float2 make(float a, float b) { return make_float2(a, b); }
  __device__ static float first(float2 v) { return v.x; }
  __device__ static float second(float2 v) { return v.y; }
};
template <>
struct Pair<__half> {
  using V = __half2;
  __device__ static __half2 make(float a, float b) {
    return __halves2half2(__float2half_rn(a), __float2half_rn(b));
  }
  __device__ static float first(__half2 v) { return __low2float(v); }
  __device__ static float second(__half2 v) { return __high2float(v); }
};
template <>
struct Pair<__nv_bfloat16> {
  using V = __nv_bfloat162;
  __device__ static __nv_bfloat162 make(float a, float b) {
    return __halves2bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
  }
  __device__ static float first(__nv_bfloat162 v) { return __low2float(v); }
  __device__ static float second(__nv_bfloat162 v) { return __high2float(v); }
};

template <typename T, bool kInverse>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ cos,
                  const float* __restrict__ sin, std::int64_t rows, std::int64_t seq_len,
                  std::int64_t freq_stride_b, std::int64_t xsb, std::int64_t xss,
                  std::int64_t xsh, int pairs, int half) {
  using P = Pair<T>;
  using V = typename P::V;
  const V* xv = reinterpret_cast<const V*>(x);
  V* yv = reinterpret_cast<V*>(y);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t b = r / seq_len, s = r - b * seq_len;
    const std::int64_t f = b * freq_stride_b + s * 2 * half;
    const std::int64_t base = r * pairs;       // y's pairs (contiguous)
    const std::int64_t xbase = (b * xsb + s * xss) / 2;  // x's, strides in elements (even)
    for (int t = threadIdx.x; t < pairs; t += kThreads) {
      const int h = t / half, j = t - h * half;
      const V in = xv[xbase + h * (xsh / 2) + j];
      const float a = P::first(in), bb = P::second(in);
      const float c = __ldg(cos + f + 2 * j), sn = __ldg(sin + f + 2 * j + 1);
      const float ac = __fmul_rn(a, c), bs = __fmul_rn(bb, sn);
      const float as = __fmul_rn(a, sn), bc = __fmul_rn(bb, c);
      yv[base + t] = kInverse ? P::make(__fadd_rn(ac, bs), __fsub_rn(bc, as))
                              : P::make(__fsub_rn(ac, bs), __fadd_rn(as, bc));
    }
  }
}

template <typename T>
void launch(const RotaryParams& p, cudaStream_t stream) {
  const std::int64_t rows = p.batch * p.seq_len;
  const int pairs = static_cast<int>(p.heads * p.head_dim / 2);
  const int half = static_cast<int>(p.head_dim / 2);
  const unsigned grid = static_cast<unsigned>(std::min(rows, kMaxBlocks));
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  if (p.inverse) {
    rotary_kernel<T, true><<<grid, kThreads, 0, stream>>>(
        x, y, p.cos, p.sin, rows, p.seq_len, p.freq_stride_b, p.x_stride_b, p.x_stride_s,
        p.x_stride_h, pairs, half);
  } else {
    rotary_kernel<T, false><<<grid, kThreads, 0, stream>>>(
        x, y, p.cos, p.sin, rows, p.seq_len, p.freq_stride_b, p.x_stride_b, p.x_stride_s,
        p.x_stride_h, pairs, half);
  }
  DS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void rotary_cuda(const RotaryParams& p, void* stream) {
  rotary_check(p, /*for_gpu=*/true);
  DS_CHECK(reinterpret_cast<std::uintptr_t>(p.x) % (2 * dtype_size(p.dtype)) == 0 &&
               reinterpret_cast<std::uintptr_t>(p.y) % (2 * dtype_size(p.dtype)) == 0,
           "rotary: p.x and p.y must be aligned to a pair of elements (",
           2 * dtype_size(p.dtype), " bytes)");
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32:
      return launch<float>(p, s);
    case DType::kFloat16:
      return launch<__half>(p, s);
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(p, s);
    case DType::kFloat64:
      break;
  }
  DS_CHECK(false, "rotary: p.dtype: float64 is supported on the CPU only");
}

}  // namespace ditscale::kernels
