// Row validation and the joining of parsed parts; see manifest_rows.h.
#include "ditscale/balance/internal/manifest_rows.h"

#include <charconv>
#include <cmath>
#include <limits>

namespace ditscale::balance::internal {
namespace {

// Parses a whole (trimmed) field as a finite double; nullopt names why not.
std::optional<double> ParseDouble(std::string_view s, std::string* why) {
  s = Trim(s);
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size()) {
    *why = "not a number: '" + std::string(s.substr(0, 40)) + "'";
    return std::nullopt;
  }
  if (!std::isfinite(v)) {
    *why = "not a finite number: '" + std::string(s) + "'";
    return std::nullopt;
  }
  return v;
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

// Parses a positive integer that fits int32 ("81" or "81.0"; not "12abc", "0", "-3", "1e99").
// Fast path of ParsePositiveInt: 1..9 plain digits (< 2^31), not zero; nullopt otherwise.
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

std::optional<int32_t> ParsePositiveInt(std::string_view s, std::string* why) {
  s = Trim(s);
  if (s.empty()) {
    *why = "missing value";
    return std::nullopt;
  }
  int64_t iv = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), iv);
  double v;
  if (ec == std::errc() && ptr == s.data() + s.size()) {
    v = static_cast<double>(iv);
  } else {
    auto d = ParseDouble(s, why);
    if (!d) return std::nullopt;
    if (*d != std::floor(*d)) {
      *why = "not an integer: '" + std::string(s) + "'";
      return std::nullopt;
    }
    v = *d;
  }
  if (v <= 0) {
    *why = "must be > 0, got '" + std::string(s) + "'";
    return std::nullopt;
  }
  if (v > std::numeric_limits<int32_t>::max()) {
    *why = "too large: '" + std::string(s) + "'";
    return std::nullopt;
  }
  return static_cast<int32_t>(v);
}

}  // namespace

std::optional<RawSample> ValidateRow(const std::array<FieldRef, kNumRequired>& f, int64_t row_line,
                                     RowError* err) {
  auto fail = [&](int slot, std::string msg) {
    *err = RowError{f[slot].present ? f[slot].line : row_line, std::string(kRequired[slot]),
                    std::move(msg)};
    return std::nullopt;
  };
  if (!f[kPath].present || f[kPath].is_null || Trim(f[kPath].text).empty()) {
    return fail(kPath, "missing value");
  }
  RawSample s;
  std::string why;
  for (int slot : {kFrames, kHeight, kWidth}) {
    if (!f[slot].present || f[slot].is_null) return fail(slot, "missing value");
    auto v = FastPositiveInt(f[slot].text);
    if (!v) v = ParsePositiveInt(f[slot].text, &why);
    if (!v) return fail(slot, why);
    (slot == kFrames ? s.num_frames : slot == kHeight ? s.height : s.width) = *v;
  }
  const FieldRef& fps = f[kFps];
  const bool fps_empty = !fps.present || fps.is_null || Trim(fps.text).empty();
  if (s.num_frames == 1) {
    // An image: fps is ignored, but if written it must still be a number.
    if (!fps_empty && !FastDecimal(fps.text) && !ParseDouble(fps.text, &why)) {
      return fail(kFps, why);
    }
    s.fps = 0;
    return s;
  }
  if (fps_empty) return fail(kFps, "missing fps for a video (num_frames > 1)");
  if (auto v = FastDecimal(fps.text); v && *v > 0) {
    s.fps = static_cast<float>(*v);
    return s;
  }
  auto v = ParseDouble(fps.text, &why);
  if (!v) return fail(kFps, why);
  if (*v <= 0)
    return fail(kFps, "fps must be > 0 for a video, got '" + std::string(Trim(fps.text)) + "'");
  s.fps = static_cast<float>(*v);
  return s;
}

Result<Manifest> Finish(std::vector<RowSink>* parts, const std::string& name,
                        const ManifestOptions& options) {
  auto failure = [&](const RowSink& p, const RowError& e) {
    return Failure{e.message, name, e.line + p.line_offset, e.column};
  };
  Manifest m;
  m.source = name;
  if (!options.skip_bad_rows) {
    for (const RowSink& p : *parts) {
      if (p.failed()) return failure(p, p.errors.front());
    }
  }
  if (parts->empty()) return m;
  size_t n = 0;
  for (const RowSink& p : *parts) n += p.samples.size();
  // The first part's arrays are reused when they can hold everything.
  RowSink& first = parts->front();
  if (first.samples.capacity() >= n && first.ids.capacity() >= n) {
    m.samples = std::move(first.samples);
    m.ids = std::move(first.ids);
  } else {
    m.samples.reserve(n);
    m.ids.reserve(n);
    m.samples.insert(m.samples.end(), first.samples.begin(), first.samples.end());
    m.ids.insert(m.ids.end(), first.ids.begin(), first.ids.end());
    std::vector<RawSample>().swap(first.samples);
    std::vector<int64_t>().swap(first.ids);
  }
  for (size_t k = 0; k < parts->size(); ++k) {
    RowSink& p = (*parts)[k];
    if (k > 0) {
      m.samples.insert(m.samples.end(), p.samples.begin(), p.samples.end());
      for (int64_t id : p.ids) m.ids.push_back(id + m.rows_total);
      std::vector<RawSample>().swap(p.samples);
      std::vector<int64_t>().swap(p.ids);
    }
    m.rows_total += p.rows;
    m.rows_skipped += p.skipped;
    for (const RowError& e : p.errors) {
      if (m.skipped_examples.size() < kMaxSkippedExamples) {
        m.skipped_examples.push_back(failure(p, e).ToString());
      }
    }
  }
  return m;
}

}  // namespace ditscale::balance::internal
