#include "ditscale/kernels/internal/fast_div.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>

namespace ditscale::kernels::internal {
namespace {

// Exact against integer division: every divisor up to 4096 at the edges of each quotient step,
// and random divisors and numerators over the whole range n < 2^31.
TEST(FastDiv, ExactForEveryNumeratorBelow2To31) {
  for (std::uint32_t d = 1; d <= 4096; ++d) {
    const FastDiv f = FastDiv::Make(d);
    for (std::uint32_t q : {0u, 1u, 2u, 1000u, (0x7fffffffu / d) - 1, 0x7fffffffu / d}) {
      for (std::int64_t delta :
           {std::int64_t{-1}, std::int64_t{0}, std::int64_t{1}, std::int64_t{d} - 1}) {
        const std::int64_t n64 = static_cast<std::int64_t>(q) * d + delta;
        if (n64 < 0 || n64 > 0x7fffffff) continue;
        const auto n = static_cast<std::uint32_t>(n64);
        ASSERT_EQ(f.Div(n), n / d) << n << " / " << d;
      }
    }
  }
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<std::uint32_t> dd(1, 0x7fffffffu), nn(0, 0x7fffffffu);
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t d = i % 2 ? dd(rng) : dd(rng) % 100000 + 1, n = nn(rng);
    ASSERT_EQ(FastDiv::Make(d).Div(n), n / d) << n << " / " << d;
  }
}

}  // namespace
}  // namespace ditscale::kernels::internal
