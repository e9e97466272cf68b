// Range checks of user-supplied numbers: CLI options, Python arguments, file fields.
//
// One rule everywhere: a value outside its documented range is an error that names the value's
// owner (option, argument or field), the value and the range, e.g.
//   "--seed: -1 is out of range [0, 18446744073709551615]"
//   "--mem-safety: -0.5 is out of range [0, 0.99]"
// Non-finite reals (NaN, inf) are always out of range. Numbers are printed compactly: integers
// exactly, reals with up to 6 significant digits (never 300 digits of DBL_MAX).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ditscale {

// "12", "-3", "0.5", "1e+09", "inf", "nan".
std::string FormatNumber(double v);
std::string FormatNumber(long long v);
std::string FormatNumber(unsigned long long v);
inline std::string FormatNumber(int v) { return FormatNumber(static_cast<long long>(v)); }
inline std::string FormatNumber(long v) { return FormatNumber(static_cast<long long>(v)); }
inline std::string FormatNumber(unsigned v) {
  return FormatNumber(static_cast<unsigned long long>(v));
}
inline std::string FormatNumber(unsigned long v) {
  return FormatNumber(static_cast<unsigned long long>(v));
}

// "<name>: <value> is out of range [lo, hi]" when v is outside [lo, hi] (or not finite), else
// nullopt.
std::optional<std::string> RangeError(std::string_view name, double v, double lo, double hi);
std::optional<std::string> RangeError(std::string_view name, long long v, long long lo,
                                      long long hi);
std::optional<std::string> RangeError(std::string_view name, unsigned long long v,
                                      unsigned long long lo, unsigned long long hi);

// Throws ditscale::Error with RangeError's message when the value is out of range.
void CheckRange(std::string_view name, double v, double lo, double hi);
void CheckRange(std::string_view name, long long v, long long lo, long long hi);

}  // namespace ditscale
