// std::floor without the libm call: x86-64's baseline instruction set has no rounding instruction
// (SSE4.1 roundsd), so std::floor is a call through the PLT; the planner and the frame rule take
// it on every micro-batch and video row.
#pragma once

#include <cmath>
#include <cstdint>

namespace ditscale::balance::internal {

// Exactly std::floor(x) for every x (NaN, infinities and -0 included): a positive x below 2^52 is
// truncated through int64 (truncation is floor there, and the integer is exact as a double); any
// other x goes to std::floor.
inline double FastFloor(double x) {
  if (x > 0 && x < 4503599627370496.0) return static_cast<double>(static_cast<int64_t>(x));
  return std::floor(x);
}

}  // namespace ditscale::balance::internal
