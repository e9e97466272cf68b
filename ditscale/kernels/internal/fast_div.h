// n / d for 32-bit n < 2^31 by a multiply-high, an add and a shift instead of a division
// (Granlund & Montgomery 1994, round-up multiplier): with shift = ceil(log2 d) and
// mul = floor(2^32 * (2^shift - d) / d) + 1, n / d = (umulhi(n, mul) + n) >> shift, exact for
// every n < 2^31 (umulhi(n, mul) < n, so the sum fits in 32 bits). A 64-bit division on the GPU
// is a ~70-instruction subroutine; kernels that split a flat row index into (b, t, h) per row use
// this instead. Host and device give the same results (fast_div_test.cc checks the host form).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DS_FAST_DIV_HD __host__ __device__
#else
#define DS_FAST_DIV_HD
#endif

namespace ditscale::kernels::internal {

struct FastDiv {
  std::uint32_t d = 1, mul = 1, shift = 0;

  // divisor >= 1.
  static FastDiv Make(std::uint32_t divisor) {
    FastDiv f;
    f.d = divisor;
    while ((std::uint64_t{1} << f.shift) < divisor) ++f.shift;
    f.mul = static_cast<std::uint32_t>(
        ((std::uint64_t{1} << 32) * ((std::uint64_t{1} << f.shift) - divisor)) / divisor + 1);
    return f;
  }

  // n / d for n < 2^31.
  DS_FAST_DIV_HD std::uint32_t Div(std::uint32_t n) const {
#if defined(__CUDA_ARCH__)
    return (__umulhi(n, mul) + n) >> shift;
#else
    return (static_cast<std::uint32_t>((std::uint64_t{n} * mul) >> 32) + n) >> shift;
#endif
  }
};

}  // namespace ditscale::kernels::internal
