// Manifest parsing: a hand-written single-pass scanner over the whole file (mmap'ed), numbers
// through std::from_chars, no allocation per field. Field views point into the file text.
#include "ditscale/balance/manifest.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>

namespace ditscale::balance {
namespace {

constexpr int kNumRequired = 5;
constexpr std::array<std::string_view, kNumRequired> kRequired = {"path", "num_frames", "height",
                                                                  "width", "fps"};
enum Slot { kPath = 0, kFrames = 1, kHeight = 2, kWidth = 3, kFps = 4 };
constexpr size_t kMaxSkippedExamples = 10;

// A required field as found in one row.
struct FieldRef {
  std::string_view text;
  int64_t line = 0;      // physical line where the field starts
  bool present = false;  // false: the row ended before this column (CSV) / key absent (JSONL)
  bool is_null = false;  // JSONL null
};

// A row-level problem: which column, on which line, and why.
struct RowError {
  int64_t line;
  std::string column;
  std::string message;
};

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

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

// Parses a positive integer that fits int32 ("81" or "81.0"; not "12abc", "0", "-3", "1e99").
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

// Validates the five required fields of one row into a RawSample.
std::optional<RawSample> ValidateRow(const std::array<FieldRef, kNumRequired>& f,
                                     int64_t row_line, RowError* err) {
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
    auto v = ParsePositiveInt(f[slot].text, &why);
    if (!v) return fail(slot, why);
    (slot == kFrames ? s.num_frames : slot == kHeight ? s.height : s.width) = *v;
  }
  const FieldRef& fps = f[kFps];
  const bool fps_empty = !fps.present || fps.is_null || Trim(fps.text).empty();
  if (s.num_frames == 1) {
    // An image: fps is ignored, but if written it must still be a number.
    if (!fps_empty && !ParseDouble(fps.text, &why)) return fail(kFps, why);
    s.fps = 0;
    return s;
  }
  if (fps_empty) return fail(kFps, "missing fps for a video (num_frames > 1)");
  auto v = ParseDouble(fps.text, &why);
  if (!v) return fail(kFps, why);
  if (*v <= 0) return fail(kFps, "fps must be > 0 for a video, got '" +
                                     std::string(Trim(fps.text)) + "'");
  s.fps = static_cast<float>(*v);
  return s;
}

// Collects good rows and handles bad ones according to the options.
class Builder {
 public:
  Builder(const std::string& name, const ManifestOptions& options, size_t text_size)
      : name_(name), options_(options) {
    m_.source = name;
    const size_t guess = text_size / 96 + 16;
    m_.samples.reserve(guess);
    m_.ids.reserve(guess);
  }
  // Returns false when parsing must stop with Failure() (strict mode).
  bool Row(const std::array<FieldRef, kNumRequired>& fields, int64_t row_line) {
    const int64_t id = m_.rows_total++;
    RowError err;
    if (auto s = ValidateRow(fields, row_line, &err)) {
      m_.samples.push_back(*s);
      m_.ids.push_back(id);
      return true;
    }
    return Bad(std::move(err));
  }
  // A row that could not even be split into fields (counts as a data row).
  bool BadRow(RowError err) {
    ++m_.rows_total;
    return Bad(std::move(err));
  }
  Failure failure() const { return failure_; }
  Manifest Take() { return std::move(m_); }

 private:
  bool Bad(RowError err) {
    Failure f{std::move(err.message), name_, err.line, std::move(err.column)};
    if (!options_.skip_bad_rows) {
      failure_ = std::move(f);
      return false;
    }
    ++m_.rows_skipped;
    if (m_.skipped_examples.size() < kMaxSkippedExamples) {
      m_.skipped_examples.push_back(f.ToString());
    }
    return true;
  }
  const std::string& name_;
  const ManifestOptions& options_;
  Manifest m_;
  Failure failure_;
};

// ---------------------------------------------------------------------------------------------
// CSV

class CsvScanner {
 public:
  explicit CsvScanner(std::string_view text) : p_(text.data()), end_(text.data() + text.size()) {
    if (text.size() >= 3 && std::memcmp(p_, "\xEF\xBB\xBF", 3) == 0) p_ += 3;  // UTF-8 BOM
  }
  bool AtEnd() const { return p_ >= end_; }
  int64_t line() const { return line_; }

  // Skips blank lines; returns false at the end of the text.
  bool SkipBlankLines() {
    while (p_ < end_) {
      if (*p_ == '\n') {
        ++p_;
        ++line_;
      } else if (*p_ == '\r') {
        ++p_;
        if (p_ < end_ && *p_ == '\n') ++p_;
        ++line_;
      } else {
        return true;
      }
    }
    return false;
  }

  // Scans one field starting at the cursor. On success, *out is the field text (for a quoted
  // field: between the quotes, with doubled quotes left doubled) and *last is true when the
  // field ended its record. On error returns false with *why set; the cursor is then left at
  // the start of the next record (or the end of the text for an unterminated quote).
  bool Field(std::string_view* out, bool* last, std::string* why) {
    if (p_ < end_ && *p_ == '"') {
      const char* start = ++p_;
      while (true) {
        const char* q = static_cast<const char*>(std::memchr(p_, '"', end_ - p_));
        if (q == nullptr) {
          line_ += std::count(p_, end_, '\n');
          p_ = end_;
          *why = "unterminated quoted field";
          return false;
        }
        line_ += std::count(p_, q, '\n');
        if (q + 1 < end_ && q[1] == '"') {
          p_ = q + 2;
          continue;
        }
        *out = std::string_view(start, q - start);
        p_ = q + 1;
        break;
      }
      if (p_ < end_ && *p_ != ',' && *p_ != '\n' && *p_ != '\r') {
        *why = "unexpected character after a closing quote";
        SkipToRecordEnd();
        return false;
      }
    } else {
      const char* start = p_;
      while (p_ < end_) {
        const char c = *p_;
        if (c == ',' || c == '\n' || c == '\r') break;
        ++p_;
      }
      *out = std::string_view(start, p_ - start);
    }
    *last = EndField();
    return true;
  }

 private:
  // Consumes the delimiter after a field; true when it ended the record.
  bool EndField() {
    if (p_ >= end_) return true;
    if (*p_ == ',') {
      ++p_;
      return false;
    }
    if (*p_ == '\r') {
      ++p_;
      if (p_ < end_ && *p_ == '\n') ++p_;
    } else {
      ++p_;  // '\n'
    }
    ++line_;
    return true;
  }
  // Error recovery: skips to the next physical line end outside quotes.
  void SkipToRecordEnd() {
    bool quoted = false;
    while (p_ < end_) {
      const char c = *p_++;
      if (c == '"') quoted = !quoted;
      if (c == '\n') {
        ++line_;
        if (!quoted) return;
      }
    }
  }

  const char* p_;
  const char* end_;
  int64_t line_ = 1;
};

Result<Manifest> ParseCsv(std::string_view text, const std::string& name,
                          const ManifestOptions& options) {
  CsvScanner sc(text);
  if (!sc.SkipBlankLines()) {
    return Failure{"empty manifest: no header row", name, 1, ""};
  }
  // Header.
  const int64_t header_line = sc.line();
  std::vector<std::string> columns;
  std::vector<int8_t> slot_of;  // per column: required slot or -1
  std::array<int, kNumRequired> column_of;
  column_of.fill(-1);
  std::string why;
  for (bool last = false; !last;) {
    std::string_view f;
    if (!sc.Field(&f, &last, &why)) return Failure{"header: " + why, name, header_line, ""};
    f = Trim(f);
    columns.emplace_back(f);
    int8_t slot = -1;
    for (int r = 0; r < kNumRequired; ++r) {
      if (f == kRequired[r]) {
        if (column_of[r] >= 0) {
          return Failure{"duplicate column in the header", name, header_line, columns.back()};
        }
        column_of[r] = static_cast<int>(columns.size()) - 1;
        slot = static_cast<int8_t>(r);
      }
    }
    slot_of.push_back(slot);
  }
  for (int r = 0; r < kNumRequired; ++r) {
    if (column_of[r] < 0) {
      return Failure{"header lacks required column (need path, num_frames, height, width, fps)",
                     name, header_line, std::string(kRequired[r])};
    }
  }
  const size_t ncols = columns.size();

  Builder b(name, options, text.size());
  std::array<FieldRef, kNumRequired> fields;
  while (sc.SkipBlankLines()) {
    const int64_t row_line = sc.line();
    for (auto& f : fields) f.present = false;
    size_t n = 0;
    bool last = false;
    bool broken = false;
    while (!last) {
      const int64_t field_line = sc.line();
      std::string_view f;
      if (!sc.Field(&f, &last, &why)) {
        const std::string col = n < ncols ? columns[n] : "";
        if (!b.BadRow({field_line, col, why})) return b.failure();
        broken = true;
        break;
      }
      if (n < ncols && slot_of[n] >= 0) fields[slot_of[n]] = FieldRef{f, field_line, true, false};
      ++n;
    }
    if (broken) continue;
    if (n != ncols) {
      RowError err{row_line, n < ncols ? columns[n] : "",
                   "wrong field count: the row has " + std::to_string(n) +
                       " fields, the header has " + std::to_string(ncols)};
      if (!b.BadRow(std::move(err))) return b.failure();
      continue;
    }
    if (!b.Row(fields, row_line)) return b.failure();
  }
  return b.Take();
}

// ---------------------------------------------------------------------------------------------
// JSONL: a flat-object scanner. Values of other keys (nested objects, arrays, strings with
// escapes) are skipped without being decoded.

class JsonLine {
 public:
  JsonLine(std::string_view s) : p_(s.data()), end_(s.data() + s.size()) {}

  // Parses the object; fills the required fields. Returns false with *why / *column on error.
  bool Parse(std::array<FieldRef, kNumRequired>* fields, int64_t line, std::string* why,
             std::string* column) {
    Ws();
    if (!Eat('{')) return Err(why, "expected '{' at the start of a JSON object");
    Ws();
    if (!Eat('}')) {
      while (true) {
        Ws();
        std::string_view key;
        bool escaped = false;
        if (!String(&key, &escaped)) return Err(why, "expected a quoted key");
        Ws();
        if (!Eat(':')) return Err(why, "expected ':' after key \"" + std::string(key) + "\"");
        Ws();
        int slot = -1;
        if (!escaped) {
          for (int r = 0; r < kNumRequired; ++r) {
            if (key == kRequired[r]) slot = r;
          }
        }
        const char* vstart = p_;
        bool is_string = false;
        std::string_view str;
        if (p_ < end_ && *p_ == '"') {
          bool esc = false;
          if (!String(&str, &esc)) {
            *column = std::string(key);
            return Err(why, "unterminated string value");
          }
          is_string = true;
        } else if (!SkipValue()) {
          *column = std::string(key);
          return Err(why, "malformed JSON value");
        }
        if (slot >= 0) {
          FieldRef& f = (*fields)[slot];
          f.present = true;
          f.line = line;
          f.text = is_string ? str : std::string_view(vstart, p_ - vstart);
          f.is_null = !is_string && f.text == "null";
          if (!is_string && (f.text == "true" || f.text == "false" || f.text.front() == '{' ||
                             f.text.front() == '[')) {
            *column = std::string(key);
            return Err(why, "expected a number, got " + std::string(f.text.substr(0, 20)));
          }
        }
        Ws();
        if (Eat(',')) continue;
        if (Eat('}')) break;
        return Err(why, "expected ',' or '}'");
      }
    }
    Ws();
    if (p_ != end_) return Err(why, "trailing characters after the JSON object");
    return true;
  }

 private:
  static bool Err(std::string* why, std::string msg) {
    *why = std::move(msg);
    return false;
  }
  void Ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\r' || *p_ == '\n')) ++p_;
  }
  bool Eat(char c) {
    if (p_ < end_ && *p_ == c) {
      ++p_;
      return true;
    }
    return false;
  }
  bool String(std::string_view* out, bool* escaped) {
    if (!Eat('"')) return false;
    const char* start = p_;
    while (p_ < end_) {
      const char c = *p_;
      if (c == '\\') {
        *escaped = true;
        p_ += 2;
        continue;
      }
      if (c == '"') {
        *out = std::string_view(start, p_ - start);
        ++p_;
        return true;
      }
      ++p_;
    }
    return false;
  }
  // Skips a number, literal, object or array.
  bool SkipValue() {
    if (p_ >= end_) return false;
    if (*p_ == '{' || *p_ == '[') {
      int depth = 0;
      while (p_ < end_) {
        const char c = *p_;
        if (c == '"') {
          std::string_view s;
          bool e;
          if (!String(&s, &e)) return false;
          continue;
        }
        if (c == '{' || c == '[') ++depth;
        if (c == '}' || c == ']') {
          if (--depth == 0) {
            ++p_;
            return true;
          }
        }
        ++p_;
      }
      return false;
    }
    const char* start = p_;
    while (p_ < end_ && *p_ != ',' && *p_ != '}' && *p_ != ' ' && *p_ != '\t' && *p_ != '\r' &&
           *p_ != '\n') {
      ++p_;
    }
    return p_ > start;
  }

  const char* p_;
  const char* end_;
};

Result<Manifest> ParseJsonl(std::string_view text, const std::string& name,
                            const ManifestOptions& options) {
  Builder b(name, options, text.size());
  const char* p = text.data();
  const char* end = p + text.size();
  if (text.size() >= 3 && std::memcmp(p, "\xEF\xBB\xBF", 3) == 0) p += 3;
  std::array<FieldRef, kNumRequired> fields;
  std::string why, column;
  for (int64_t line = 1; p < end; ++line) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
    const char* le = nl ? nl : end;
    std::string_view s(p, le - p);
    p = nl ? nl + 1 : end;
    if (Trim(s).empty() || (Trim(s) == "\r")) continue;
    for (auto& f : fields) f = FieldRef{};
    column.clear();
    if (!JsonLine(s).Parse(&fields, line, &why, &column)) {
      if (!b.BadRow({line, column, why})) return b.failure();
      continue;
    }
    if (!b.Row(fields, line)) return b.failure();
  }
  return b.Take();
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// A read-only view of a whole file: mmap'ed, or read into a buffer where mmap fails.
class FileText {
 public:
  ~FileText() {
    if (map_ != nullptr) munmap(map_, size_);
  }
  std::optional<std::string> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::string("cannot open: ") + std::strerror(errno);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      ::close(fd);
      return std::string("cannot stat: ") + std::strerror(errno);
    }
    size_ = static_cast<size_t>(st.st_size);
    if (S_ISREG(st.st_mode) && size_ > 0) {
      void* m = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (m != MAP_FAILED) {
        map_ = m;
        madvise(map_, size_, MADV_SEQUENTIAL | MADV_WILLNEED);
        ::close(fd);
        return std::nullopt;
      }
    }
    char buf[1 << 16];
    for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) != 0;) {
      if (n < 0) {
        if (errno == EINTR) continue;
        ::close(fd);
        return std::string("cannot read: ") + std::strerror(errno);
      }
      data_.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    return std::nullopt;
  }
  std::string_view text() const {
    return map_ ? std::string_view(static_cast<const char*>(map_), size_) : data_;
  }

 private:
  void* map_ = nullptr;
  size_t size_ = 0;
  std::string data_;
};

}  // namespace

Result<Manifest> ParseManifest(std::string_view text, const std::string& name,
                               const ManifestOptions& options) {
  std::string format = options.format;
  if (format.empty()) {
    format = EndsWith(name, ".jsonl") || EndsWith(name, ".json") ? "jsonl" : "csv";
  }
  if (format == "csv") return ParseCsv(text, name, options);
  if (format == "jsonl") return ParseJsonl(text, name, options);
  return Failure{"unknown manifest format '" + format + "' (use csv or jsonl)", name, 0, ""};
}

Result<Manifest> ReadManifest(const std::string& path, const ManifestOptions& options) {
  FileText file;
  if (auto err = file.Open(path)) return Failure{*err, path, 0, ""};
  return ParseManifest(file.text(), path, options);
}

}  // namespace ditscale::balance
