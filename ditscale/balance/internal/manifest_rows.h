// Row-level pieces shared by the CSV and JSONL manifest readers (manifest.cc,
// internal/csv_manifest.cc): the required columns, one row's field views, validation of a row
// into a RawSample, and RowSink, which collects the rows of one contiguous part of a file so
// that parts parsed on different threads can be joined in file order (Finish).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ditscale/balance/manifest.h"
#include "ditscale/core/result.h"

namespace ditscale::balance::internal {

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
  int64_t line = 0;
  std::string column;
  std::string message;
};

// Strips leading and trailing spaces and tabs.
inline std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Validates the five required fields of one row (row_line: the record's first line, used for
// absent fields) into a RawSample; nullopt with *err naming line, column and reason.
std::optional<RawSample> ValidateRow(const std::array<FieldRef, kNumRequired>& f, int64_t row_line,
                                     RowError* err);

// The rows of one contiguous part of a manifest, in file order. Ids and lines are relative to
// the part; Finish adds each part's offsets.
class RowSink {
 public:
  // skip_bad_rows: see ManifestOptions. reserve: expected number of rows.
  RowSink(bool skip_bad_rows, size_t reserve) : skip_bad_rows_(skip_bad_rows) {
    samples.reserve(reserve);
    ids.reserve(reserve);
  }
  // Validates and stores one row; false when parsing must stop (strict mode, a bad row).
  bool Row(const std::array<FieldRef, kNumRequired>& fields, int64_t row_line) {
    const int64_t id = rows++;
    RowError err;
    if (auto s = ValidateRow(fields, row_line, &err)) {
      samples.push_back(*s);
      ids.push_back(id);
      return true;
    }
    return Bad(std::move(err));
  }
  // A row that could not even be split into fields (counts as a data row).
  bool BadRow(RowError err) {
    ++rows;
    return Bad(std::move(err));
  }
  // True when a bad row stopped a strict parse (errors.front() is it).
  bool failed() const { return !skip_bad_rows_ && !errors.empty(); }

  std::vector<RawSample> samples;  // good rows
  std::vector<int64_t> ids;        // their row numbers within the part (0-based)
  int64_t rows = 0;                // rows seen (good + bad)
  int64_t skipped = 0;             // bad rows (skip mode)
  std::vector<RowError> errors;    // the first kMaxSkippedExamples bad rows (strict: the one)
  int64_t line_offset = 0;         // added to every line of the part (set by the caller)

 private:
  bool Bad(RowError err) {
    if (!skip_bad_rows_) {
      errors.push_back(std::move(err));
      return false;
    }
    ++skipped;
    if (errors.size() < kMaxSkippedExamples) errors.push_back(std::move(err));
    return true;
  }
  bool skip_bad_rows_;
};

// Joins the parts (in file order) into a Manifest of file `name`: ids offset by the rows of the
// earlier parts, lines by each part's line_offset; in strict mode the first part's failure, if
// any, is the result. Moves the data out of the parts.
Result<Manifest> Finish(std::vector<RowSink>* parts, const std::string& name,
                        const ManifestOptions& options);

}  // namespace ditscale::balance::internal
