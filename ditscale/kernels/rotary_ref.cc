// CPU implementation of the rotary embedding (rotary.h): the float32 arithmetic of the formula,
// each product and sum rounded on its own (the pragma keeps the compiler from contracting a*c -
// b*s into a fused multiply-add, which would round once), so that the CPU gives the CUDA
// kernel's bits and diffusers' formula's.
#pragma GCC optimize("fp-contract=off")

#include <cstdint>

#include "ditscale/core/error.h"
#include "ditscale/kernels/rotary.h"

namespace ditscale::kernels {
namespace {

// One pair: (a, b) rotated by (c, s), forward or inverse, in the arithmetic type F.
template <typename F>
void rotate(F a, F b, F c, F s, bool inverse, F& y0, F& y1) {
  const F ac = a * c, bs = b * s, as = a * s, bc = b * c;
  if (inverse) {
    y0 = ac + bs;
    y1 = bc - as;
  } else {
    y0 = ac - bs;
    y1 = as + bc;
  }
}

}  // namespace

void rotary_ref(const RotaryParams& p) {
  rotary_check(p, /*for_gpu=*/false);
  const std::int64_t dh = p.head_dim, half = dh / 2, row = p.heads * dh;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t s = 0; s < p.seq_len; ++s) {
      const std::int64_t r = b * p.seq_len + s;
      const float* cos = p.cos + b * p.freq_stride_b + s * dh;
      const float* sin = p.sin + b * p.freq_stride_b + s * dh;
      for (std::int64_t h = 0; h < p.heads; ++h) {
        for (std::int64_t j = 0; j < half; ++j) {
          const std::int64_t i = r * row + h * dh + 2 * j;  // y: contiguous
          const std::int64_t k = b * p.x_stride_b + s * p.x_stride_s + h * p.x_stride_h + 2 * j;
          if (p.dtype == DType::kFloat64) {
            const double* x = static_cast<const double*>(p.x);
            double* y = static_cast<double*>(p.y);
            rotate<double>(x[k], x[k + 1], cos[2 * j], sin[2 * j + 1], p.inverse, y[i], y[i + 1]);
            continue;
          }
          float y0 = 0.f, y1 = 0.f;
          rotate<float>(static_cast<float>(load_as_double(p.x, p.dtype, k)),
                        static_cast<float>(load_as_double(p.x, p.dtype, k + 1)), cos[2 * j],
                        sin[2 * j + 1], p.inverse, y0, y1);
          store_from_double(p.y, p.dtype, i, y0);  // exact for a float value: one rounding
          store_from_double(p.y, p.dtype, i + 1, y1);
        }
      }
    }
  }
}

}  // namespace ditscale::kernels
