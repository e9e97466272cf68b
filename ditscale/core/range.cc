#include "ditscale/core/range.h"

#include <charconv>
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

// v as FormatNumber writes it, unless that reads like a bound it exceeds ("1.0000001" is not
// "1 is out of range [0, 1]"): then its shortest exact form.
std::string ValueText(double v, double lo, double hi) {
  std::string text = FormatNumber(v);
  if (std::isfinite(v) && (text == FormatNumber(lo) || text == FormatNumber(hi))) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    text.assign(buf, r.ptr);
  }
  return text;
}
template <typename T>
std::string ValueText(T v, T, T) {
  return FormatNumber(v);
}

template <typename T>
std::string OutOfRange(std::string_view name, T v, T lo, T hi) {
  std::string s(name);
  s += ": " + ValueText(v, lo, hi) + " is out of range [" + FormatNumber(lo) + ", " +
       FormatNumber(hi) + "]";
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
