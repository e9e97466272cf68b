// CSV manifest parsing: a hand-written scanner over the text (field views point into it, no
// allocation per field), SSE2 searches for the bytes that end a field, and a two-thread split
// for large files (see csv_manifest.h).
#include "ditscale/balance/internal/csv_manifest.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "ditscale/balance/internal/manifest_rows.h"

namespace ditscale::balance::internal {
namespace {

// First position in [p, end) holding a or b; end when none.
inline const char* FindEither(const char* p, const char* end, char a, char b) {
#if defined(__SSE2__)
  const __m128i va = _mm_set1_epi8(a), vb = _mm_set1_epi8(b);
  for (; end - p >= 16; p += 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const int m = _mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(x, va), _mm_cmpeq_epi8(x, vb)));
    if (m != 0) return p + __builtin_ctz(static_cast<unsigned>(m));
  }
#endif
  while (p < end && *p != a && *p != b) ++p;
  return p;
}

// First position in [p, end) holding ',', '\n' or '\r' (the end of an unquoted field).
inline const char* FindFieldEnd(const char* p, const char* end) {
#if defined(__SSE2__)
  const __m128i vc = _mm_set1_epi8(','), vn = _mm_set1_epi8('\n'), vr = _mm_set1_epi8('\r');
  for (; end - p >= 16; p += 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, vc), _mm_cmpeq_epi8(x, vn)),
                                     _mm_cmpeq_epi8(x, vr));
    const int m = _mm_movemask_epi8(hit);
    if (m != 0) return p + __builtin_ctz(static_cast<unsigned>(m));
  }
#endif
  while (p < end && *p != ',' && *p != '\n' && *p != '\r') ++p;
  return p;
}

// Drops the pages of a private read-only file mapping once the parser is past them.
class PageReleaser {
 public:
  PageReleaser(const char* base, const char* from, bool enabled)
      : base_(base), page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))), enabled_(enabled) {
    done_ = base_ + (static_cast<size_t>(from - base_) / page_) * page_;
  }
  // Everything before p will not be read again by this parser.
  void Upto(const char* p) {
    if (!enabled_ || p - done_ < kStep) return;
    const char* to = base_ + (static_cast<size_t>(p - base_) / page_) * page_;
    madvise(const_cast<char*>(done_), static_cast<size_t>(to - done_), MADV_DONTNEED);
    done_ = to;
  }

 private:
  static constexpr ptrdiff_t kStep = ptrdiff_t{16} << 20;
  const char* base_;
  size_t page_;
  bool enabled_;
  const char* done_;
};

// Whether [p, end) holds an odd number of bytes equal to c.
bool OddCount(const char* p, const char* end, char c, PageReleaser* rel) {
  uint64_t parity = 0;
#if defined(__SSE2__)
  const __m128i vc = _mm_set1_epi8(c);
  while (end - p >= 64) {
    const char* block_end = p + std::min<ptrdiff_t>((end - p) & ~ptrdiff_t{63}, ptrdiff_t{1} << 20);
    for (; p < block_end; p += 64) {
      // XOR of the match masks: its bit count has the parity of the matches.
      const auto* q = reinterpret_cast<const __m128i*>(p);
      const __m128i x = _mm_xor_si128(_mm_xor_si128(_mm_cmpeq_epi8(_mm_loadu_si128(q), vc),
                                                    _mm_cmpeq_epi8(_mm_loadu_si128(q + 1), vc)),
                                      _mm_xor_si128(_mm_cmpeq_epi8(_mm_loadu_si128(q + 2), vc),
                                                    _mm_cmpeq_epi8(_mm_loadu_si128(q + 3), vc)));
      parity ^= static_cast<unsigned>(_mm_movemask_epi8(x));
    }
    rel->Upto(p);
  }
#endif
  parity = static_cast<uint64_t>(__builtin_parityll(parity));
  return ((parity + static_cast<uint64_t>(std::count(p, end, c))) & 1) != 0;
}

class CsvScanner {
 public:
  CsvScanner(const char* p, const char* end, int64_t line) : p_(p), end_(end), line_(line) {}
  const char* pos() const { return p_; }
  const char* end() const { return end_; }
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

  // Fast path of a whole record: one physical line of at most kMaxLineBytes ending in '\n' (or
  // "\r\n"), with no quote, no other '\r' and exactly `ncols` fields. Splits it at the commas
  // into the required slots (slot_of[column] >= 0) of *fields, all on line `line`, moves the
  // cursor past it and returns true; returns false with the cursor unchanged for any other
  // record (the general path then gives the same fields, or the error).
  bool PlainRecord(const int8_t* slot_of, size_t ncols, std::array<FieldRef, kNumRequired>* fields,
                   int64_t line) {
#if defined(__SSE2__)
    const char* p = p_;
    size_t col = 0;
    const char* field = p;
    auto comma = [&](const char* at) {
      if (col < ncols && slot_of[col] >= 0) {
        (*fields)[slot_of[col]] = FieldRef{std::string_view(field, at - field), line, true, false};
      }
      ++col;
      field = at + 1;
    };
    const __m128i vc = _mm_set1_epi8(','), vq = _mm_set1_epi8('"'), vr = _mm_set1_epi8('\r'),
                  vn = _mm_set1_epi8('\n');
    // One pass over 16-byte blocks up to the first '\n'; the last 15 bytes of the text (and a
    // "\r\n" split across two blocks) are left to the general path.
    for (const char* q = p;; q += 16) {
      if (end_ - q < 16 || q - p > static_cast<ptrdiff_t>(kMaxLineBytes)) return false;
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      const auto lf = static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, vn)));
      const unsigned first_lf = lf & (0u - lf);
      const unsigned before = lf ? first_lf - 1 : 0xFFFFu;  // bytes before the line end
      if (static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, vq))) & before) return false;
      const unsigned cr = static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, vr))) & before;
      if (cr != 0 && cr != (first_lf >> 1)) return false;  // only a '\r' right before '\n'
      for (unsigned m = static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, vc))) & before;
           m != 0; m &= m - 1) {
        comma(q + __builtin_ctz(m));
      }
      if (lf == 0) continue;
      const char* nl = q + __builtin_ctz(lf);
      if (static_cast<size_t>(nl - p) > kMaxLineBytes) return false;
      comma(cr != 0 ? nl - 1 : nl);
      if (col != ncols) return false;
      p_ = nl + 1;
      ++line_;
      return true;
    }
#else
    return false;
#endif
  }

  // Scans one field starting at the cursor. On success, *out is the field text (for a quoted
  // field: between the quotes, with doubled quotes left doubled) and *last is true when the
  // field ended its record. On error returns false with *why set; the cursor is then left at
  // the start of the next record (or the end of the text for an unterminated quote).
  bool Field(std::string_view* out, bool* last, std::string* why) {
    if (p_ < end_ && *p_ == '"') {
      const char* start = ++p_;
      while (true) {
        const char* q = FindEither(p_, end_, '"', '\n');
        if (q == end_) {
          p_ = end_;
          *why = "unterminated quoted field";
          return false;
        }
        if (*q == '\n') {
          ++line_;
          p_ = q + 1;
          continue;
        }
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
      p_ = FindFieldEnd(p_, end_);
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
  int64_t line_;
};

struct Header {
  std::vector<std::string> columns;
  std::vector<int8_t> slot_of;  // per column: required slot or -1
};

// The 0-based index of the first physical line of [p, end) longer than kMaxLineBytes (bytes
// before its '\n'), or -1.
int64_t FirstLongLine(const char* p, const char* end) {
  for (int64_t k = 0;; ++k) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
    const char* le = nl ? nl : end;
    if (static_cast<size_t>(le - p) > kMaxLineBytes) return k;
    if (!nl) return -1;
    p = nl + 1;
  }
}

// Parses the data rows from the scanner's position into *sink until the text ends or a record
// ends past `stop`. Returns false when the parse stopped (strict mode and a bad row, or a limit).
bool ParseRows(CsvScanner& sc, const Header& h, const char* stop, RowSink* sink, PageReleaser* rel,
               bool fast) {
  const size_t ncols = h.columns.size();
  std::array<FieldRef, kNumRequired> fields;
  std::string why;
  RowError broken;
  while (sc.pos() <= stop && sc.SkipBlankLines()) {
    rel->Upto(sc.pos());
    const char* record = sc.pos();
    const int64_t row_line = sc.line();
    if (fast && sc.PlainRecord(h.slot_of.data(), ncols, &fields, row_line)) {
      // Every field starts before the cursor: 8 bytes past it are readable from each.
      if (!sink->Row(fields, row_line, sc.end() - sc.pos() >= 8)) return false;
      continue;
    }
    for (auto& f : fields) f.present = false;
    size_t n = 0;
    bool last = false;
    bool ok = true;
    while (!last) {
      const int64_t field_line = sc.line();
      std::string_view f;
      if (!sc.Field(&f, &last, &why)) {
        broken = RowError{field_line, n < ncols ? h.columns[n] : "", why};
        ok = false;
        break;
      }
      if (n < ncols && h.slot_of[n] >= 0) {
        fields[h.slot_of[n]] = FieldRef{f, field_line, true, false};
      }
      ++n;
    }
    if (static_cast<size_t>(sc.pos() - record) > kMaxLineBytes) {
      if (const int64_t k = FirstLongLine(record, sc.pos()); k >= 0) {
        sink->BadRow({row_line + k, "", LineTooLong(), true});
        return false;
      }
    }
    if (!ok) {
      if (!sink->BadRow(std::move(broken))) return false;
      continue;
    }
    if (n != ncols) {
      RowError err{row_line, n < ncols ? h.columns[n] : "",
                   "wrong field count: the row has " + std::to_string(n) +
                       " fields, the header has " + std::to_string(ncols)};
      if (!sink->BadRow(std::move(err))) return false;
      continue;
    }
    if (!sink->Row(fields, row_line, sc.end() - sc.pos() >= 8)) return false;
  }
  return true;
}

// Bytes per line of the first 64 KiB of [p, end) (for the reservation); 0 when unknown.
double BytesPerLine(const char* p, const char* end) {
  const size_t n = std::min<size_t>(static_cast<size_t>(end - p), 1 << 16);
  const auto lines = std::count(p, p + n, '\n');
  return lines > 0 ? static_cast<double>(n) / static_cast<double>(lines) : 0;
}

// The first line end outside quotes at or after `from`, given whether `from` is inside a quoted
// field; returns the position after it, or end.
const char* NextRecordStart(const char* from, const char* end, bool in_quotes) {
  for (const char* p = from;;) {
    const char* q = FindEither(p, end, '"', '\n');
    if (q == end) return end;
    if (*q == '"') {
      in_quotes = !in_quotes;
    } else if (!in_quotes) {
      return q + 1;
    }
    p = q + 1;
  }
}

// The header row: its columns and the slot of each required one (Header::slot_of).
std::optional<Failure> ParseHeader(CsvScanner& sc, const std::string& name, Header* h) {
  const int64_t header_line = sc.line();
  const char* header_start = sc.pos();
  std::array<int, kNumRequired> column_of;
  column_of.fill(-1);
  std::string why;
  for (bool last = false; !last;) {
    std::string_view f;
    if (h->columns.size() >= kMaxColumns) {
      return Failure{"header has more than " + std::to_string(kMaxColumns) + " columns (the limit)",
                     name, header_line, ""};
    }
    if (!sc.Field(&f, &last, &why)) {
      if (FirstLongLine(header_start, sc.pos()) >= 0) break;
      return Failure{"header: " + why, name, header_line, ""};
    }
    f = Trim(f);
    h->columns.emplace_back(f);
    int8_t slot = -1;
    for (int r = 0; r < kNumRequired; ++r) {
      if (f == kRequired[r]) {
        if (column_of[r] >= 0) {
          return Failure{"duplicate column in the header", name, header_line, h->columns.back()};
        }
        column_of[r] = static_cast<int>(h->columns.size()) - 1;
        slot = static_cast<int8_t>(r);
      }
    }
    h->slot_of.push_back(slot);
  }
  if (const int64_t k = FirstLongLine(header_start, sc.pos()); k >= 0) {
    return Failure{LineTooLong(), name, header_line + k, ""};
  }
  for (int r = 0; r < kNumRequired; ++r) {
    if (column_of[r] < 0) {
      return Failure{"header lacks required column (need path, num_frames, height, width, fps)",
                     name, header_line, std::string(kRequired[r])};
    }
  }

  return std::nullopt;
}

}  // namespace

Result<std::vector<RowSink>> ParseCsvRows(std::string_view text, const std::string& name,
                                          const ManifestOptions& options,
                                          const CsvParseOptions& csv,
                                          const BucketChooser* chooser) {
  const char* begin = text.data();
  const char* end = begin + text.size();
  const char* p = begin;
  if (text.size() >= 3 && std::memcmp(p, "\xEF\xBB\xBF", 3) == 0) p += 3;  // UTF-8 BOM
  CsvScanner sc(p, end, 1);
  if (!sc.SkipBlankLines()) {
    return Failure{"empty manifest: no header row", name, 1, ""};
  }
  Header h;
  if (auto f = ParseHeader(sc, name, &h)) return *f;

  const char* data = sc.pos();
  const size_t data_bytes = static_cast<size_t>(end - data);
  const bool parallel = csv.force_parallel || (data_bytes >= csv.min_parallel_bytes &&
                                               std::thread::hardware_concurrency() >= 2);
  const double bytes_per_line = BytesPerLine(data, end);
  std::vector<RowSink> parts;
  parts.emplace_back(options.skip_bad_rows, RowsToReserve(data_bytes, bytes_per_line), chooser);
  PageReleaser rel(begin, data, csv.release_pages);
  if (!parallel || data_bytes < 2) {
    ParseRows(sc, h, end, &parts[0], &rel, csv.plain_fast_path);
    return parts;
  }

  // Two parts: [data, b2) here, [b2, end) on a second thread, b2 being the first record start
  // after the middle as far as quote parity tells. std::jthread joins on every way out; an
  // exception of the worker (std::bad_alloc) is rethrown here after the join.
  const char* split = data + data_bytes / 2;
  const char* b2 = end;
  RowSink second(options.skip_bad_rows,
                 RowsToReserve(static_cast<size_t>(end - split), bytes_per_line), chooser);
  std::exception_ptr worker_error;
  std::jthread worker([&] {
    try {
      PageReleaser count_rel(begin, data, csv.release_pages);
      const bool in_quotes = OddCount(data, split, '"', &count_rel);
      b2 = NextRecordStart(split, end, in_quotes);
      CsvScanner sc2(b2, end, 0);
      PageReleaser rel2(begin, b2, csv.release_pages);
      ParseRows(sc2, h, end, &second, &rel2, csv.plain_fast_path);
    } catch (...) {
      worker_error = std::current_exception();
    }
  });
  const bool ok = ParseRows(sc, h, split, &parts[0], &rel, csv.plain_fast_path);
  worker.join();
  if (worker_error) std::rethrow_exception(worker_error);
  if (ok && sc.pos() != b2) {
    // The guess was wrong (malformed quoting near the middle): continue sequentially.
    ParseRows(sc, h, end, &parts[0], &rel, csv.plain_fast_path);
  } else if (ok) {
    second.line_offset = sc.line();
    parts.push_back(std::move(second));
  }
  return parts;
}

Result<Manifest> ParseCsvManifest(std::string_view text, const std::string& name,
                                  const ManifestOptions& options, const CsvParseOptions& csv) {
  auto parts = ParseCsvRows(text, name, options, csv, nullptr);
  if (!parts.ok()) return parts.failure();
  return Finish(&*parts, name, options);
}

}  // namespace ditscale::balance::internal
