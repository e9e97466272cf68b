// Parameter validation of the rotary embedding (rotary.h); host only, built with or without CUDA.
#include <cstdint>
#include <limits>

#include "ditscale/core/error.h"
#include "ditscale/kernels/rotary.h"

namespace ditscale::kernels {

void rotary_check(const RotaryParams& p, bool for_gpu) {
  DS_CHECK(p.x != nullptr && p.y != nullptr, "rotary: p.x and p.y must not be null");
  DS_CHECK(p.cos != nullptr && p.sin != nullptr, "rotary: p.cos and p.sin must not be null");
  DS_CHECK(p.dtype == DType::kFloat32 || p.dtype == DType::kFloat16 ||
               p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat64,
           "rotary: p.dtype: invalid value ", static_cast<int>(p.dtype));
  DS_CHECK(!for_gpu || p.dtype != DType::kFloat64,
           "rotary: p.dtype: float64 is supported on the CPU only");
  DS_CHECK(p.batch >= 1, "rotary: p.batch must be >= 1, got ", p.batch);
  DS_CHECK(p.seq_len >= 1, "rotary: p.seq_len must be >= 1, got ", p.seq_len);
  DS_CHECK(p.heads >= 1, "rotary: p.heads must be >= 1, got ", p.heads);
  DS_CHECK(p.head_dim >= 2 && p.head_dim % 2 == 0,
           "rotary: p.head_dim must be even and >= 2, got ", p.head_dim);
  DS_CHECK(p.x_stride_b >= 0 && p.x_stride_s >= 0 && p.x_stride_h >= 0 &&
               p.x_stride_b % 2 == 0 && p.x_stride_s % 2 == 0 && p.x_stride_h % 2 == 0,
           "rotary: p.x_stride_b/s/h must be even and >= 0, got (", p.x_stride_b, ", ",
           p.x_stride_s, ", ", p.x_stride_h, ")");
  // Every index fits int64 and a row's pairs fit int32 (the kernel's per-row loop).
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 8;
  DS_CHECK(p.heads <= kMax / p.head_dim && p.batch <= kMax / p.seq_len &&
               p.batch * p.seq_len <= kMax / (p.heads * p.head_dim),
           "rotary: B * S * H * Dh = ", p.batch, " * ", p.seq_len, " * ", p.heads, " * ",
           p.head_dim, " overflows");
  DS_CHECK(p.freq_stride_b == 0 || p.freq_stride_b == p.seq_len * p.head_dim,
           "rotary: p.freq_stride_b must be 0 or seq_len * head_dim = ", p.seq_len * p.head_dim,
           ", got ", p.freq_stride_b);
  DS_CHECK(p.heads * p.head_dim / 2 <= std::numeric_limits<std::int32_t>::max(),
           "rotary: H * Dh / 2 = ", p.heads * p.head_dim / 2, " is above 2^31 - 1");
}

}  // namespace ditscale::kernels
