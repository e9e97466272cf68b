#include "ditscale/core/range.h"

#include <cmath>
#include <cstdio>

#include "ditscale/core/error.h"

namespace ditscale {

std::string FormatNumber(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string FormatNumber(long long v) { return std::to_string(v); }
std::string FormatNumber(unsigned long long v) { return std::to_string(v); }

namespace {
template <typename T>
std::string OutOfRange(std::string_view name, T v, T lo, T hi) {
  std::string s(name);
  s += ": " + FormatNumber(v) + " is out of range [" + FormatNumber(lo) + ", " + FormatNumber(hi) +
       "]";
  return s;
}
}  // namespace

std::optional<std::string> RangeError(std::string_view name, double v, double lo, double hi) {
  if (std::isfinite(v) && v >= lo && v <= hi) return std::nullopt;
  return OutOfRange(name, v, lo, hi);
}

std::optional<std::string> RangeError(std::string_view name, long long v, long long lo,
                                      long long hi) {
  if (v >= lo && v <= hi) return std::nullopt;
  return OutOfRange(name, v, lo, hi);
}

std::optional<std::string> RangeError(std::string_view name, unsigned long long v,
                                      unsigned long long lo, unsigned long long hi) {
  if (v >= lo && v <= hi) return std::nullopt;
  return OutOfRange(name, v, lo, hi);
}

void CheckRange(std::string_view name, double v, double lo, double hi) {
  if (auto e = RangeError(name, v, lo, hi)) throw Error(*e);
}

void CheckRange(std::string_view name, long long v, long long lo, long long hi) {
  if (auto e = RangeError(name, v, lo, hi)) throw Error(*e);
}

}  // namespace ditscale
