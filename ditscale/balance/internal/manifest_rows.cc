// The field rules of manifest.h and the joining of parsed parts; see manifest_rows.h.
#include "ditscale/balance/internal/manifest_rows.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "ditscale/balance/internal/swar_digits.h"
#include "ditscale/core/range.h"

namespace ditscale::balance::internal {
namespace {

// How a field's text parsed as a number.
enum class Num { kOk, kNotNumber, kOutOfRange };

// Parses a whole (trimmed) field as a double: kOutOfRange for NaN, inf and numbers beyond a
// double (1e400, 1e-400), kNotNumber for anything else that is not exactly one number.
Num ParseDouble(std::string_view s, double* v) {
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
  if (ptr != s.data() + s.size() || s.empty()) return Num::kNotNumber;
  if (ec == std::errc::result_out_of_range) return Num::kOutOfRange;
  if (ec != std::errc()) return Num::kNotNumber;
  return std::isfinite(*v) ? Num::kOk : Num::kOutOfRange;
}

// Fast path for the common "24" / "23.976": digits, optionally '.' and digits, at most 15
// digits in all. The mantissa m < 10^15 and 10^k (k <= 15) are exact doubles, so m / 10^k is
// the correctly rounded value, the same double std::from_chars returns. nullopt: use the
// general path (which also produces the error messages).
std::optional<double> FastDecimal(std::string_view s) {
  static constexpr double kPow10[] = {1e0, 1e1, 1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                      1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15};
  size_t i = 0, n = s.size();
  uint64_t m = 0;
  int digits = 0;
  while (i < n && s[i] >= '0' && s[i] <= '9') {
    m = m * 10 + static_cast<uint64_t>(s[i++] - '0');
    ++digits;
  }
  if (digits == 0) return std::nullopt;
  int frac = 0;
  if (i < n && s[i] == '.') {
    ++i;
    while (i < n && s[i] >= '0' && s[i] <= '9') {
      m = m * 10 + static_cast<uint64_t>(s[i++] - '0');
      ++frac;
    }
    if (frac == 0) return std::nullopt;
  }
  if (i != n || digits + frac > 15) return std::nullopt;
  return static_cast<double>(m) / kPow10[frac];
}

// Fast path of ParseDimension: 1..9 plain digits (< 2^31), not zero; nullopt otherwise.
inline std::optional<int32_t> FastPositiveInt(std::string_view s) {
  if (s.empty() || s.size() > 9) return std::nullopt;
  int32_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v == 0) return std::nullopt;
  return v;
}

std::string OutOfRange(std::string_view s, double lo, double hi) {
  return Shown(s) + " is out of range [" + FormatNumber(lo) + ", " + FormatNumber(hi) + "]";
}
std::string OutOfRange(std::string_view s, long long lo, long long hi) {
  return Shown(s) + " is out of range [" + FormatNumber(lo) + ", " + FormatNumber(hi) + "]";
}

// num_frames / height / width: an integer in [1, kMaxDimension] ("81", " 81 ", "81.0", "8.1e1").
std::optional<int32_t> ParseDimension(std::string_view s, std::string* why) {
  s = Trim(s);
  if (s.empty()) {
    *why = "missing value";
    return std::nullopt;
  }
  int64_t iv = 0;
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), iv);
  if (ec == std::errc() && ptr == s.data() + s.size()) {
    v = static_cast<double>(iv);
  } else {
    const Num r = ParseDouble(s, &v);
    if (r == Num::kNotNumber) {
      *why = "not a number: " + Shown(s);
      return std::nullopt;
    }
    if (r == Num::kOk && v != std::floor(v)) {
      *why = "not an integer: " + Shown(s);
      return std::nullopt;
    }
    if (r == Num::kOutOfRange) v = std::numeric_limits<double>::quiet_NaN();
  }
  if (!(v >= 1 && v <= kMaxDimension)) {
    *why = OutOfRange(s, 1LL, static_cast<long long>(kMaxDimension));
    return std::nullopt;
  }
  return static_cast<int32_t>(v);
}

// fps: a number in [lo, kMaxFps].
std::optional<double> ParseFps(std::string_view s, double lo, std::string* why) {
  s = Trim(s);
  double v = 0;
  if (auto f = FastDecimal(s)) {
    v = *f;
  } else {
    const Num r = ParseDouble(s, &v);
    if (r == Num::kNotNumber) {
      *why = "not a number: " + Shown(s);
      return std::nullopt;
    }
    if (r == Num::kOutOfRange) v = std::numeric_limits<double>::quiet_NaN();
  }
  if (!(v >= lo && v <= kMaxFps)) {
    *why = OutOfRange(s, lo, kMaxFps) + (lo > 0 ? " for a video (num_frames > 1)" : "");
    return std::nullopt;
  }
  return v;
}

// The type rules of JSONL: a string where a number belongs, or true/false/an object/an array.
std::optional<std::string> TypeError(const FieldRef& f, bool want_string) {
  if (f.type == FieldType::kText) return std::nullopt;
  if (want_string) {
    if (f.type == FieldType::kString) return std::nullopt;
    return "expected a string, got " + Shown(f.text);
  }
  if (f.type == FieldType::kNumber) return std::nullopt;
  if (f.type == FieldType::kString) return "expected a number, got the string " + Shown(f.text);
  return "expected a number, got " + Shown(f.text);
}

}  // namespace

std::string LineTooLong() {
  return "line longer than the " + std::to_string(kMaxLineBytes) + "-byte limit";
}

std::string Shown(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  const size_t n = std::min(s.size(), kMaxShownBytes);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > n) out += "...";
  out += "'";
  return out;
}

namespace {

// FastPositiveInt, word-parallel when 8 bytes can be loaded from the field (swar_digits.h).
// Returns through *v (a bool result: an optional's return goes through memory).
inline bool PositiveInt(std::string_view s, bool padded, int32_t* v) {
  if (kSwarDigits && padded && !s.empty() && s.size() <= 8) {
    uint64_t x = 0;
    if (!SwarDigits(s.data(), s.size(), &x) || x == 0) return false;
    *v = static_cast<int32_t>(x);
    return true;
  }
  const auto r = FastPositiveInt(s);
  *v = r.value_or(0);
  return r.has_value();
}

// FastDecimal, word-parallel when 8 bytes can be loaded from the field: the same mantissa and
// fraction digits, so the same double.
inline bool Decimal(std::string_view s, bool padded, double* v) {
  if (kSwarDigits && padded && !s.empty() && s.size() <= 8) {
    static constexpr double kPow10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7};
    uint64_t m = 0;
    int frac = 0;
    if (!SwarDecimal(s.data(), s.size(), &m, &frac)) return false;
    *v = static_cast<double>(m) / kPow10[frac];
    return true;
  }
  const auto r = FastDecimal(s);
  *v = r.value_or(0);
  return r.has_value();
}

}  // namespace

bool FastValidateRow(const std::array<FieldRef, kNumRequired>& f, RawSample* s, bool padded) {
  for (const FieldRef& x : f) {
    if (!x.present || x.type != FieldType::kText) return false;
  }
  const std::string_view path = f[kPath].text;
  if (path.empty() || path.front() == ' ' || path.front() == '\t') return false;
  int32_t frames = 0, height = 0, width = 0;
  if (!PositiveInt(f[kFrames].text, padded, &frames) ||
      !PositiveInt(f[kHeight].text, padded, &height) ||
      !PositiveInt(f[kWidth].text, padded, &width)) {
    return false;
  }
  s->num_frames = frames;
  s->height = height;
  s->width = width;
  const std::string_view fps = f[kFps].text;
  double v = 0;
  if (frames == 1) {
    s->fps = 0;
    return fps.empty() || (Decimal(fps, padded, &v) && v <= kMaxFps);
  }
  if (!Decimal(fps, padded, &v) || !(v >= kMinVideoFps && v <= kMaxFps)) return false;
  s->fps = static_cast<float>(v);
  return true;
}

std::optional<RawSample> ValidateRow(const std::array<FieldRef, kNumRequired>& f, int64_t row_line,
                                     RowError* err) {
  auto fail = [&](int slot, std::string msg) {
    *err = RowError{f[slot].present ? f[slot].line : row_line, std::string(kRequired[slot]),
                    std::move(msg)};
    return std::nullopt;
  };
  const FieldRef& path = f[kPath];
  if (!path.present || path.is_null) return fail(kPath, "missing value");
  if (path.type != FieldType::kText) {
    if (auto e = TypeError(path, true)) return fail(kPath, *e);
  }
  if (Trim(path.text).empty()) return fail(kPath, "missing value");
  RawSample s;
  std::string why;
  for (int slot : {kFrames, kHeight, kWidth}) {
    if (!f[slot].present || f[slot].is_null) return fail(slot, "missing value");
    if (f[slot].type != FieldType::kText) {
      if (auto e = TypeError(f[slot], false)) return fail(slot, *e);
    }
    auto v = FastPositiveInt(f[slot].text);
    if (!v) v = ParseDimension(f[slot].text, &why);
    if (!v) return fail(slot, why);
    (slot == kFrames ? s.num_frames : slot == kHeight ? s.height : s.width) = *v;
  }
  const FieldRef& fps = f[kFps];
  const bool fps_empty =
      !fps.present || fps.is_null || (fps.type == FieldType::kText && Trim(fps.text).empty());
  if (!fps_empty && fps.type != FieldType::kText) {
    if (auto e = TypeError(fps, false)) return fail(kFps, *e);
  }
  if (s.num_frames == 1) {
    // An image: fps is ignored, but if written it must still be a number in [0, kMaxFps].
    if (!fps_empty && !ParseFps(fps.text, 0, &why)) return fail(kFps, why);
    s.fps = 0;
    return s;
  }
  if (fps_empty) return fail(kFps, "missing fps for a video (num_frames > 1)");
  auto v = ParseFps(fps.text, kMinVideoFps, &why);
  if (!v) return fail(kFps, why);
  s.fps = static_cast<float>(*v);
  return s;
}

RowSink::RowSink(bool skip_bad_rows, size_t reserve, const BucketChooser* chooser)
    : skip_bad_rows_(skip_bad_rows), reserve_(reserve) {
  if (chooser != nullptr) {
    mapper.emplace(*chooser);
    shape_of.reserve(reserve);
  } else {
    samples.reserve(reserve);
  }
}

void RowSink::WriteOutIds() {
  ids.reserve(std::max(reserve_, static_cast<size_t>(good_) + 1));
  for (int64_t k = 0; k < good_; ++k) ids.push_back(k);
  dense_ids = false;
}

bool RowSink::TooManyRows(int64_t line) {
  return Fatal(
      RowError{line, "", "more than " + std::to_string(kMaxRows) + " data rows (the limit)", true});
}

size_t RowsToReserve(size_t bytes, double bytes_per_row) {
  constexpr size_t kCap = size_t{64} << 20;
  if (!(bytes_per_row > 0)) bytes_per_row = 96;
  const double want = static_cast<double>(bytes) / bytes_per_row * 1.05 + 16;
  return static_cast<size_t>(
      std::min({want, static_cast<double>(kCap), static_cast<double>(kMaxRows)}));
}

std::optional<Failure> CheckParts(const std::vector<RowSink>& parts, const std::string& name,
                                  const ManifestOptions& options, Manifest* counts) {
  auto failure = [&](const RowSink& p, const RowError& e) {
    return Failure{e.message, name, e.line + p.line_offset, e.column};
  };
  int64_t rows = 0;
  for (const RowSink& p : parts) {
    if (!options.skip_bad_rows && !p.errors.empty()) return failure(p, p.errors.front());
    if (p.fatal) return failure(p, *p.fatal);
    rows += p.rows;
  }
  if (rows > kMaxRows) {
    return Failure{"more than " + std::to_string(kMaxRows) + " data rows (the limit)", name,
                   parts.back().line_offset + 1, ""};
  }
  counts->source = name;
  counts->rows_total = rows;
  counts->rows_skipped = 0;
  counts->skipped_examples.clear();
  for (const RowSink& p : parts) {
    counts->rows_skipped += p.skipped;
    for (const RowError& e : p.errors) {
      if (counts->skipped_examples.size() < kMaxSkippedExamples) {
        counts->skipped_examples.push_back(failure(p, e).ToString());
      }
    }
  }
  return std::nullopt;
}

Result<Manifest> Finish(std::vector<RowSink>* parts, const std::string& name,
                        const ManifestOptions& options) {
  Manifest m;
  if (auto f = CheckParts(*parts, name, options, &m)) return *f;
  if (parts->empty()) return m;
  size_t n = 0;
  for (const RowSink& p : *parts) n += p.samples.size();
  // The first part's array is reused when it can hold everything.
  RowSink& first = parts->front();
  if (first.samples.capacity() >= n) {
    m.samples = std::move(first.samples);
  } else {
    m.samples.reserve(n);
    m.samples.insert(m.samples.end(), first.samples.begin(), first.samples.end());
    std::vector<RawSample>().swap(first.samples);
  }
  m.ids.reserve(n);
  int64_t offset = 0;
  for (size_t k = 0; k < parts->size(); ++k) {
    RowSink& p = (*parts)[k];
    if (k > 0) {
      m.samples.insert(m.samples.end(), p.samples.begin(), p.samples.end());
      std::vector<RawSample>().swap(p.samples);
    }
    for (int64_t i = 0; i < p.good(); ++i) m.ids.push_back(p.id_of(i) + offset);
    std::vector<int64_t>().swap(p.ids);
    offset += p.rows;
  }
  return m;
}

}  // namespace ditscale::balance::internal
