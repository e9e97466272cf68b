// JSONL manifest parsing: one ParseJson per line, the required keys' values typed into
// FieldRefs, rows validated by internal/manifest_rows.cc.
#include "ditscale/balance/internal/jsonl_manifest.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "ditscale/balance/internal/manifest_rows.h"
#include "ditscale/core/json_text.h"

namespace ditscale::balance::internal {
namespace {

// Bytes of the first few lines per line (for the reservation); 0 when the text has no line end.
double BytesPerLine(std::string_view text) {
  const size_t n = std::min<size_t>(text.size(), 1 << 16);
  const auto lines = std::count(text.data(), text.data() + n, '\n');
  return lines > 0 ? static_cast<double>(n) / static_cast<double>(lines) : 0;
}

// The number texts as written of the required top-level keys of a line that ParseJson has
// accepted (valid JSON, one object, no repeated key): keys written with escapes are not found
// (the caller then uses the library's text of the number, which denotes the same double).
class RawNumbers {
 public:
  explicit RawNumbers(std::string_view s) : p_(s.data()), end_(s.data() + s.size()) {
    Ws();
    if (!Eat('{')) return;
    while (true) {
      Ws();
      std::string_view key;
      bool escaped = false;
      if (!String(&key, &escaped)) return;
      Ws();
      if (!Eat(':')) return;
      Ws();
      const char* v = p_;
      if (p_ < end_ && *p_ == '"') {
        std::string_view ignored;
        if (!String(&ignored, &escaped)) return;
      } else {
        Skip();
        for (int r = 0; r < kNumRequired && !escaped; ++r) {
          if (key == kRequired[r]) text_[r] = std::string_view(v, p_ - v);
        }
      }
      Ws();
      if (!Eat(',')) return;
    }
  }
  std::string_view text(int slot) const { return text_[slot]; }

 private:
  void Ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\r' || *p_ == '\n')) ++p_;
  }
  bool Eat(char c) {
    if (p_ < end_ && *p_ == c) return ++p_, true;
    return false;
  }
  bool String(std::string_view* out, bool* escaped) {
    if (!Eat('"')) return false;
    const char* start = p_;
    for (; p_ < end_; ++p_) {
      if (*p_ == '\\') {
        *escaped = true;
        ++p_;
      } else if (*p_ == '"') {
        *out = std::string_view(start, p_ - start);
        ++p_;
        return true;
      }
    }
    return false;
  }
  // Skips a number, literal, object or array (strings inside skipped as strings).
  void Skip() {
    int depth = 0;
    while (p_ < end_) {
      const char c = *p_;
      if (c == '"') {
        std::string_view s;
        bool e = false;
        if (!String(&s, &e)) return;
        continue;
      }
      if (depth == 0 && (c == ',' || c == '}' || c == ' ' || c == '\t' || c == '\r')) return;
      if (c == '{' || c == '[') ++depth;
      if (c == '}' || c == ']') --depth;
      ++p_;
    }
  }

  const char* p_;
  const char* end_;
  std::array<std::string_view, kNumRequired> text_{};
};

// The value of one required key as a FieldRef (its text kept in *storage; a number's text as
// written when `raw` has it).
FieldRef ToField(const nlohmann::json& v, std::string_view raw, int64_t line,
                 std::string* storage) {
  FieldRef f;
  f.present = true;
  f.line = line;
  if (v.is_null()) {
    f.is_null = true;
    return f;
  }
  if (v.is_string()) {
    *storage = v.get<std::string>();
    f.type = FieldType::kString;
    f.text = *storage;
  } else if (v.is_number() && !raw.empty()) {
    f.type = FieldType::kNumber;
    f.text = raw;
  } else {
    *storage = v.dump();
    f.type = v.is_number() ? FieldType::kNumber : FieldType::kOther;
    f.text = *storage;
  }
  return f;
}

// One line: a bad-row error, or the row handed to the sink. False when parsing must stop.
bool ParseLine(std::string_view s, int64_t line, const std::string& name, RowSink* sink) {
  auto parsed = ParseJson(s, name, line);
  if (!parsed.ok()) return sink->BadRow({line, "", parsed.failure().message});
  const nlohmann::json& j = *parsed;
  if (!j.is_object()) {
    return sink->BadRow({line, "", "expected a JSON object, got " + Shown(j.dump())});
  }
  const RawNumbers raw(s);
  std::array<FieldRef, kNumRequired> fields;
  std::array<std::string, kNumRequired> storage;
  for (int r = 0; r < kNumRequired; ++r) {
    auto it = j.find(kRequired[r]);
    if (it != j.end()) fields[r] = ToField(*it, raw.text(r), line, &storage[r]);
  }
  return sink->Row(fields, line);
}

// Parses the lines of [p, end) into *sink (lines numbered from 1); returns the number of lines.
int64_t ParseLines(const char* p, const char* end, const std::string& name, RowSink* sink) {
  int64_t line = 1;
  for (; p < end; ++line) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
    const char* le = nl ? nl : end;
    std::string_view s(p, le - p);
    p = nl ? nl + 1 : end;
    if (s.size() > kMaxLineBytes) {
      sink->BadRow({line, "", LineTooLong(), true});
      break;
    }
    if (!s.empty() && s.back() == '\r') s.remove_suffix(1);
    if (Trim(s).empty()) continue;
    if (!ParseLine(s, line, name, sink)) break;
  }
  return line - 1;
}

}  // namespace

Result<Manifest> ParseJsonlManifest(std::string_view text, const std::string& name,
                                    const ManifestOptions& options, size_t min_parallel_bytes) {
  const char* p = text.data();
  const char* end = p + text.size();
  if (text.size() >= 3 && std::memcmp(p, "\xEF\xBB\xBF", 3) == 0) p += 3;  // UTF-8 BOM
  const size_t bytes = static_cast<size_t>(end - p);
  const double per_line = BytesPerLine(std::string_view(p, bytes));
  const char* split = end;
  if (bytes >= min_parallel_bytes && bytes >= 2 && std::thread::hardware_concurrency() >= 2) {
    const char* nl =
        static_cast<const char*>(std::memchr(p + bytes / 2, '\n', end - (p + bytes / 2)));
    if (nl) split = nl + 1;
  }
  std::vector<RowSink> parts;
  parts.emplace_back(options.skip_bad_rows, RowsToReserve(bytes, per_line));
  if (split == end) {
    ParseLines(p, end, name, &parts[0]);
    return Finish(&parts, name, options);
  }
  // Two parts; std::jthread joins on every way out, a worker exception is rethrown after it.
  parts.emplace_back(options.skip_bad_rows, RowsToReserve(end - split, per_line));
  std::exception_ptr worker_error;
  {
    std::jthread worker([&] {
      try {
        ParseLines(split, end, name, &parts[1]);
      } catch (...) {
        worker_error = std::current_exception();
      }
    });
    parts[1].line_offset = ParseLines(p, split, name, &parts[0]);
  }
  if (worker_error) std::rethrow_exception(worker_error);
  return Finish(&parts, name, options);
}

}  // namespace ditscale::balance::internal
