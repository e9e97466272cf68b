// Manifest reading: the file is mmap'ed; CSV is parsed by internal/csv_manifest.cc, JSONL here by
// a flat-object scanner; rows are validated and collected by internal/manifest_rows.cc.
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

#include "ditscale/balance/internal/csv_manifest.h"
#include "ditscale/balance/internal/manifest_rows.h"

namespace ditscale::balance {
namespace {

using internal::FieldRef;
using internal::kNumRequired;
using internal::kRequired;
using internal::Trim;

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
  std::vector<internal::RowSink> parts;
  parts.emplace_back(options.skip_bad_rows, text.size() / 96 + 16);
  internal::RowSink& b = parts[0];
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
      if (!b.BadRow({line, column, why})) break;
      continue;
    }
    if (!b.Row(fields, line)) break;
  }
  return internal::Finish(&parts, name, options);
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
        madvise(map_, size_, MADV_SEQUENTIAL);
        madvise(map_, size_, MADV_WILLNEED);
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
  bool mapped() const { return map_ != nullptr; }
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
  if (format == "csv") return internal::ParseCsvManifest(text, name, options);
  if (format == "jsonl") return ParseJsonl(text, name, options);
  return Failure{"unknown manifest format '" + format + "' (use csv or jsonl)", name, 0, ""};
}

Result<Manifest> ReadManifest(const std::string& path, const ManifestOptions& options) {
  FileText file;
  if (auto err = file.Open(path)) return Failure{*err, path, 0, ""};
  std::string format = options.format;
  if (format.empty()) {
    format = EndsWith(path, ".jsonl") || EndsWith(path, ".json") ? "jsonl" : "csv";
  }
  if (format == "csv") {
    // The parser drops the mapping's pages behind it: the file never counts whole in RSS.
    internal::CsvParseOptions csv;
    csv.release_pages = file.mapped();
    return internal::ParseCsvManifest(file.text(), path, options, csv);
  }
  return ParseManifest(file.text(), path, options);
}

}  // namespace ditscale::balance
