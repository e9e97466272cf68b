// Branch-light parsing of short numeric fields (at most 8 bytes) within one 64-bit word: the
// digit check and the value of every byte at once (SWAR), instead of a loop whose exit on the
// field's length mispredicts. The field must be followed by readable bytes so that 8 bytes can be
// loaded from its start (the bytes past the field are masked off and never affect the result).
//
// Digits: a byte c is a digit iff its high nibble is 3 and that of c + 6 is 3 too (c <= '9');
// adding 6 to every byte cannot carry into a kept byte unless a lower kept byte is >= 0xFA,
// which already fails the first test. Value: the digits right-aligned in the word (leading zero
// bytes), then pairs, quads and the eight combined by three multiplications
// (10 * 2^8 + 1, 100 * 2^16 + 1, 10000 * 2^32 + 1).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ditscale::balance::internal {

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
inline constexpr bool kSwarDigits = true;
#else
inline constexpr bool kSwarDigits = false;  // callers use their byte loops
#endif

// The low `len` bytes of a word (len in [1, 8]).
inline uint64_t LowBytes(size_t len) {
  return len >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * len)) - 1;
}

// The low `len` bytes of x (len in [1, 8]; the first byte of the field is the lowest) are all
// ASCII digits: true with *v their decimal value.
inline bool WordDigits(uint64_t x, size_t len, uint64_t* v) {
  constexpr uint64_t kHigh = 0xF0F0F0F0F0F0F0F0ull, k3 = 0x3030303030303030ull;
  const uint64_t keep = LowBytes(len);
  const uint64_t bad = (((x & kHigh) ^ k3) | (((x + 0x0606060606060606ull) & kHigh) ^ k3)) & keep;
  if (bad != 0) return false;
  uint64_t d = (x & 0x0F0F0F0F0F0F0F0Full & keep) << (8 * (8 - len));
  d = (d * 2561) >> 8;
  d = ((d & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
  *v = ((d & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32;
  return true;
}

inline uint64_t LoadWord(const char* p) {
  uint64_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// [p, p + len), len in [1, 8], 8 bytes readable from p: plain digits; true with *v.
inline bool SwarDigits(const char* p, size_t len, uint64_t* v) {
  return WordDigits(LoadWord(p), len, v);
}

// [p, p + len), len in [1, 8], 8 bytes readable from p: digits, optionally '.' and at least one
// digit ("24", "23.976"; not ".5", "24.", "1.2.3"). True with *mantissa the digits without the
// point and *frac the digits after it (the value is mantissa / 10^frac).
inline bool SwarDecimal(const char* p, size_t len, uint64_t* mantissa, int* frac) {
  const uint64_t x = LoadWord(p);
  // Bytes equal to '.': zero bytes of t, found exactly (no borrow between bytes).
  const uint64_t t = x ^ 0x2E2E2E2E2E2E2E2Eull;
  const uint64_t nonzero = ((t & 0x7F7F7F7F7F7F7F7Full) + 0x7F7F7F7F7F7F7F7Full) | t;
  const uint64_t dots = ~nonzero & 0x8080808080808080ull & LowBytes(len);
  if (dots == 0) {
    *frac = 0;
    return WordDigits(x, len, mantissa);
  }
  const size_t k = static_cast<size_t>(__builtin_ctzll(dots)) / 8;  // the first '.'
  if (k == 0 || k + 1 >= len) return false;
  const uint64_t before = LowBytes(k);
  *frac = static_cast<int>(len - 1 - k);
  // The bytes after the point moved down over it: len - 1 digits (a second '.' fails).
  return WordDigits((x & before) | ((x >> 8) & ~before), len - 1, mantissa);
}

}  // namespace ditscale::balance::internal
