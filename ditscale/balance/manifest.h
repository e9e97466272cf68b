// Training-corpus manifests: Open-Sora-style CSV and JSONL (Parquet: see ManifestOptions::format).
//
// CSV: a header row, then one row per sample. Required columns (any order):
//   path, num_frames, height, width, fps
// Any other column (caption, aesthetic score, ...) is ignored. RFC-4180 quoting: fields may be
// quoted with ", a quoted field may hold commas, newlines and doubled quotes ("").
// JSONL: one JSON object per line with the same keys (other keys ignored); blank lines are
// skipped. Each line is parsed by ditscale/core/json_text.h (strict JSON: a repeated key, a
// number beyond a double such as 1e400, or a syntax error is a bad row naming file:line).
//
// Field rules: one set for both formats (CSV fields are text; the same text rules apply to the
// JSON number as written). Every number may be surrounded by spaces/tabs (CSV); numbers beyond a
// double (1e400, 1e-400), NaN and inf are out of range.
//   path        CSV: non-empty text; JSONL: a non-empty string (after trimming spaces/tabs)
//   num_frames  an integer in [1, kMaxDimension]; 1 means an image ("81.0" and 8.1e1 are 81)
//   height      an integer in [1, kMaxDimension] (pixels)
//   width       an integer in [1, kMaxDimension] (pixels)
//   fps         video (num_frames > 1): a number in [kMinVideoFps, kMaxFps];
//               image: empty (CSV) / null or absent (JSONL), or a number in [0, kMaxFps];
//               it is ignored and stored as 0
// In JSONL the numeric fields must be JSON numbers (a string "81" or true is a bad row: "expected
// a number"), and null is the same as an empty CSV field (a missing value).
//
// Limits (checked before the memory they bound is allocated; exceeding one is an error even with
// skip_bad_rows, since such a file is not a manifest):
//   kMaxLineBytes    bytes of one physical line (so /dev/zero fails at line 1 after 1 MiB);
//   kMaxColumns      CSV header columns;
//   kMaxRows         data rows (good + bad);
//   kMaxFileBytes    a regular file's size (mmap'ed, never read whole into memory);
//   kMaxStreamBytes  bytes of a non-regular file (pipe, FIFO, character device), which is read
//                    into memory as it arrives (line lengths checked while reading).
// Directories are refused.
//
// Sample ids are the 0-based order of the data rows (bad rows that are skipped keep their id
// unused, so ids stay stable when a file is repaired).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ditscale/core/result.h"

namespace ditscale::balance {

inline constexpr int32_t kMaxDimension = 2147483647;  // num_frames, height, width: int32 max
inline constexpr double kMinVideoFps = 1e-3;          // a video's fps range [1e-3, 1e6]
inline constexpr double kMaxFps = 1e6;
inline constexpr size_t kMaxLineBytes = size_t{1} << 20;        // 1 MiB
inline constexpr size_t kMaxColumns = 1024;                     // CSV header columns
inline constexpr int64_t kMaxRows = 1'000'000'000;              // 24 GB of samples + ids
inline constexpr uint64_t kMaxFileBytes = uint64_t{1} << 40;    // 1 TiB (regular files)
inline constexpr uint64_t kMaxStreamBytes = uint64_t{4} << 30;  // 4 GiB (pipes, devices)

// One sample's raw shape. 16 bytes: a 10M-row manifest takes 160 MB.
struct RawSample {
  int32_t num_frames = 0;  // [1, kMaxDimension]; 1 means an image
  int32_t height = 0;      // pixels, [1, kMaxDimension]
  int32_t width = 0;       // pixels, [1, kMaxDimension]
  float fps = 0;           // frames per second, [kMinVideoFps, kMaxFps]; 0 for images
};

struct Manifest {
  std::string source;              // file the rows came from
  std::vector<int64_t> ids;        // sample id of each entry of `samples` (0-based row order)
  std::vector<RawSample> samples;  // the good rows, in file order
  int64_t rows_total = 0;          // data rows read (good + bad)
  int64_t rows_skipped = 0;        // bad rows skipped under skip_bad_rows
  std::vector<std::string> skipped_examples;  // the first few skip reasons (file:line: ...)
};

struct ManifestOptions {
  // false: the first bad row is a Failure naming file, line and column.
  // true: bad rows are skipped and counted (rows_skipped), the first 10 reasons kept.
  bool skip_bad_rows = false;
  // "csv", "jsonl", "parquet", or "" to decide from the extension (.jsonl/.json -> jsonl,
  // .parquet/.pq -> parquet, else csv). Parquet: internal/parquet_manifest.h (the same columns
  // and field rules; a bad row's line is its 1-based row number).
  std::string format;
};

// Reads a manifest file. Failures: the file cannot be opened or read, is a directory or exceeds
// a limit, the header misses a required column or repeats one (line 1, that column), or a bad
// row when !skip_bad_rows. Never throws (out of memory is a Failure too).
// A bad row's Failure names the 1-based physical line where the offending field starts (a
// record whose quoted caption spans lines reports the line of the bad field; a wrong field
// count reports the record's first line) and the column (header name; empty for extra fields
// and for JSON syntax errors). Messages quote at most 40 bytes of a field, with control bytes
// written \xNN.
// Bad rows: a field breaking its rule above (missing value, not a number, trailing garbage
// "12abc", non-integer, out of range), an unterminated quote (which swallows the rest of the
// file), a character after a closing quote, a wrong field count, a JSONL line that is not one
// valid JSON object.
// CSV: the file is mmap'ed and scanned once without per-field allocation; files of 32 MB or more
// are parsed by two threads (the second half is kept only where it starts exactly at the record
// the first thread reaches, so ids, lines and errors are those of one sequential pass), and pages
// are released behind the parser. JSONL lines are parsed one by one by ParseJson (~3.5 us of
// CPU a row), on two threads for texts of 1 MiB or more.
Result<Manifest> ReadManifest(const std::string& path, const ManifestOptions& options = {});

// Parses manifest text already in memory; `name` is used in error messages. The same rules and
// limits (but kMaxStreamBytes) apply.
Result<Manifest> ParseManifest(std::string_view text, const std::string& name,
                               const ManifestOptions& options = {});

}  // namespace ditscale::balance
