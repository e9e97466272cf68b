// FastFloor is std::floor bit for bit: the edges of its fast range, signed zeros, NaN,
// infinities, and a million random doubles of every magnitude and sign.
#include "ditscale/balance/internal/fast_floor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

namespace ditscale::balance::internal {
namespace {

uint64_t Bits(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

void ExpectFloor(double x) {
  const double want = std::floor(x), got = FastFloor(x);
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << x;
  } else {
    EXPECT_EQ(Bits(got), Bits(want)) << x;
  }
}

TEST(FastFloor, EdgesAndSpecialValues) {
  constexpr double k52 = 4503599627370496.0, inf = std::numeric_limits<double>::infinity();
  for (double x : {0.0, -0.0, 1e-300, -1e-300, 0.5, -0.5, 1.0, -1.0, 1.0 - 1e-16, 2.5, -2.5,
                   k52 - 0.5, k52, k52 + 1, -k52 + 0.5, 9.3e18, 1e300, -1e300, inf, -inf,
                   std::numeric_limits<double>::quiet_NaN(),
                   std::numeric_limits<double>::denorm_min()}) {
    ExpectFloor(x);
  }
  EXPECT_TRUE(std::signbit(FastFloor(-0.0)));
}

TEST(FastFloor, RandomDoublesOfEveryMagnitude) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-60, 70);
  for (int i = 0; i < 1000000; ++i) ExpectFloor(std::ldexp(mantissa(rng), exponent(rng)));
}

}  // namespace
}  // namespace ditscale::balance::internal
