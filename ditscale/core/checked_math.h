// Overflow-checked 64-bit integer arithmetic for shape and size computations.
//
// Shape arithmetic on user input (VAE strides, patch sizes, frame counts, world sizes) is done in
// int64 through these helpers; an overflow is an error that names what was being computed, never
// a wrapped value or a division by a product that wrapped to zero.
#pragma once

#include <cstdint>
#include <string_view>

#include "ditscale/core/error.h"

namespace ditscale {

// a * b, or throws ditscale::Error("<what>: a * b overflows int64").
inline int64_t CheckedMul(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) [[unlikely]] {
    throw Error(internal::StrCat(what, ": ", a, " * ", b, " overflows int64"));
  }
  return r;
}

// a + b, or throws ditscale::Error("<what>: a + b overflows int64").
inline int64_t CheckedAdd(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) [[unlikely]] {
    throw Error(internal::StrCat(what, ": ", a, " + ", b, " overflows int64"));
  }
  return r;
}

// a * b when it fits in int64, else false (for Result-returning code paths).
inline bool MulFits(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool AddFits(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

}  // namespace ditscale
