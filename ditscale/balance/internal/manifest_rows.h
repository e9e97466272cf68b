// Row-level pieces shared by the CSV and JSONL manifest readers (internal/csv_manifest.cc,
// internal/jsonl_manifest.cc): the required columns, one row's field views, the field rules of
// manifest.h applied to a row (ValidateRow), and RowSink, which collects the rows of one
// contiguous part of a file so that parts parsed on different threads can be joined in file
// order (Finish).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ditscale/balance/internal/shape_mapper.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/core/result.h"

namespace ditscale::balance::internal {

constexpr int kNumRequired = 5;
constexpr std::array<std::string_view, kNumRequired> kRequired = {"path", "num_frames", "height",
                                                                  "width", "fps"};
enum Slot { kPath = 0, kFrames = 1, kHeight = 2, kWidth = 3, kFps = 4 };
constexpr size_t kMaxSkippedExamples = 10;
constexpr size_t kMaxShownBytes = 40;  // bytes of a field quoted in an error message

// What a field's text is: CSV text (any field), or a JSON value's kind.
enum class FieldType : uint8_t {
  kText,    // CSV field text
  kNumber,  // JSON number, text as written back by the JSON library (round-trips exactly)
  kString,  // JSON string, its decoded value
  kOther,   // JSON true/false/object/array, text as dumped
};

// A required field as found in one row.
struct FieldRef {
  std::string_view text;
  int64_t line = 0;      // physical line where the field starts
  bool present = false;  // false: the row ended before this column (CSV) / key absent (JSONL)
  bool is_null = false;  // JSONL null
  FieldType type = FieldType::kText;
};

// A row-level problem: which column, on which line, and why. `fatal`: a broken limit, which
// ends the parse even with skip_bad_rows.
struct RowError {
  int64_t line = 0;
  std::string column;
  std::string message;
  bool fatal = false;
};

// Strips leading and trailing spaces and tabs.
inline std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// The message of a physical line longer than kMaxLineBytes (the same for CSV, JSONL and a
// stream read).
std::string LineTooLong();

// A field for an error message: quoted, at most kMaxShownBytes bytes ("..." after a cut),
// bytes below 0x20 and 0x7f written \xNN: 'ab\x00c'.
std::string Shown(std::string_view s);

// Applies the field rules of manifest.h to the five required fields of one row (row_line: the
// record's first line, used for absent fields); nullopt with *err naming line, column, reason.
std::optional<RawSample> ValidateRow(const std::array<FieldRef, kNumRequired>& f, int64_t row_line,
                                     RowError* err);

// The common case of ValidateRow, without building any error text: every field plain CSV text,
// a path not starting with a space or tab, plain-digit integers, fps empty or plain decimal
// digits within its range. True: *s is the sample ValidateRow gives; false: call ValidateRow.
// padded: 8 bytes can be read from the start of every field (the numbers of at most 8 bytes are
// then parsed word-parallel, internal/swar_digits.h; the result is the same).
bool FastValidateRow(const std::array<FieldRef, kNumRequired>& f, RawSample* s,
                     bool padded = false);

// The rows of one contiguous part of a manifest, in file order. Ids and lines are relative to
// the part; Finish adds each part's offsets. At most kMaxRows rows per part.
// Without a chooser the good rows are kept as samples; with one (the fused shape mapping of
// shaped_reader.h) each good row is mapped at once to a local shape index (shape_of) by the
// part's ShapeMapper and no sample is kept. While no row was bad the ids are 0..good-1 and not
// stored (dense_ids); the first bad row writes them out.
class RowSink {
 public:
  // skip_bad_rows: see ManifestOptions. reserve: expected number of rows (capped).
  RowSink(bool skip_bad_rows, size_t reserve, const BucketChooser* chooser = nullptr);
  // Validates and stores one row; false when parsing must stop (strict mode and a bad row, or a
  // limit broken). padded: see FastValidateRow.
  bool Row(const std::array<FieldRef, kNumRequired>& fields, int64_t row_line,
           bool padded = false) {
    if (rows >= kMaxRows) return TooManyRows(row_line);
    const int64_t id = rows++;
    RawSample fast;
    if (FastValidateRow(fields, &fast, padded)) {
      Keep(fast, id);
      return true;
    }
    RowError err;
    if (auto s = ValidateRow(fields, row_line, &err)) {
      Keep(*s, id);
      return true;
    }
    return Bad(std::move(err));
  }
  // A row that could not even be split into fields (counts as a data row), or (err.fatal) a
  // broken limit.
  bool BadRow(RowError err) {
    if (err.fatal) return Fatal(std::move(err));
    if (rows >= kMaxRows) return TooManyRows(err.line);
    ++rows;
    return Bad(std::move(err));
  }
  // True when this part's parse was stopped by a bad row (strict) or a broken limit.
  bool failed() const { return fatal.has_value() || (!skip_bad_rows_ && !errors.empty()); }
  // Good rows kept (samples or shape indices).
  int64_t good() const { return good_; }
  // The id (row number within the part) of the k-th good row.
  int64_t id_of(int64_t k) const { return dense_ids ? k : ids[static_cast<size_t>(k)]; }

  std::vector<RawSample> samples;  // good rows (without a chooser)
  std::vector<int32_t> shape_of;   // with a chooser: per good row, its index into mapper's shapes
  std::optional<ShapeMapper> mapper;
  bool dense_ids = true;          // the ids are 0..good()-1 and `ids` is empty
  std::vector<int64_t> ids;       // !dense_ids: the good rows' row numbers within the part
  int64_t rows = 0;               // rows seen (good + bad)
  int64_t skipped = 0;            // bad rows (skip mode)
  std::vector<RowError> errors;   // the first kMaxSkippedExamples bad rows (strict: the one)
  std::optional<RowError> fatal;  // the broken limit that stopped the parse
  int64_t line_offset = 0;        // added to every line of the part (set by the caller)

 private:
  void Keep(const RawSample& s, int64_t id) {
    if (mapper) {
      shape_of.push_back(mapper->Map(s, good_));
    } else {
      samples.push_back(s);
    }
    if (!dense_ids) ids.push_back(id);
    ++good_;
  }
  bool Bad(RowError err) {
    if (!skip_bad_rows_) {
      errors.push_back(std::move(err));
      return false;
    }
    if (dense_ids) WriteOutIds();
    ++skipped;
    if (errors.size() < kMaxSkippedExamples) errors.push_back(std::move(err));
    return true;
  }
  bool Fatal(RowError err) {
    fatal = std::move(err);
    fatal->fatal = true;
    return false;
  }
  bool TooManyRows(int64_t line);
  void WriteOutIds();
  bool skip_bad_rows_;
  size_t reserve_;
  int64_t good_ = 0;
};

// The number of rows to reserve for a text of `bytes` bytes whose first rows average
// `bytes_per_row` bytes (<= 0: unknown, 96 assumed): ~5% over the estimate, capped at 64M rows
// (the vectors grow past that when needed) and at kMaxRows.
size_t RowsToReserve(size_t bytes, double bytes_per_row);

// The outcome of the parts (in file order) of file `name`: the first part that failed gives the
// Failure (its strict-mode bad row or its broken limit; lines offset by the part's line_offset);
// else *counts gets source, rows_total, rows_skipped and skipped_examples (not samples or ids).
std::optional<Failure> CheckParts(const std::vector<RowSink>& parts, const std::string& name,
                                  const ManifestOptions& options, Manifest* counts);

// Joins the parts (in file order) into a Manifest of file `name`: CheckParts, then the samples
// and the ids, offset by the rows of the earlier parts. Moves the data out of the parts.
Result<Manifest> Finish(std::vector<RowSink>* parts, const std::string& name,
                        const ManifestOptions& options);

}  // namespace ditscale::balance::internal
