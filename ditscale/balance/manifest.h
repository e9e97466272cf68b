// Training-corpus manifests: Open-Sora-style CSV and JSONL.
//
// CSV: a header row, then one row per sample. Required columns (any order):
//   path, num_frames, height, width, fps
// Any other column (caption, aesthetic score, ...) is ignored. RFC-4180 quoting: fields may be
// quoted with ", a quoted field may hold commas, newlines and doubled quotes ("").
// JSONL: one JSON object per line with the same keys; blank lines are skipped.
// An image has num_frames == 1; its fps may be empty or 0 and is ignored. A video
// (num_frames > 1) needs fps > 0.
//
// Sample ids are the 0-based order of the data rows (bad rows that are skipped keep their id
// unused, so ids stay stable when a file is repaired).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/core/result.h"

namespace ditscale::balance {

// One sample's raw shape. 16 bytes: a 10M-row manifest takes 160 MB.
struct RawSample {
  int32_t num_frames = 0;  // >= 1; 1 means an image
  int32_t height = 0;      // pixels, > 0
  int32_t width = 0;       // pixels, > 0
  float fps = 0;           // frames per second; 0 for images
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
  // "csv", "jsonl", or "" to decide from the extension (.jsonl/.json -> jsonl, else csv).
  std::string format;
};

// Reads a manifest file. Failures: the file cannot be opened, the header misses a required
// column (line 1, that column), or a bad row when !skip_bad_rows.
// A bad row's Failure names the 1-based physical line where the offending field starts (a
// record whose quoted caption spans lines reports the line of the bad field; a wrong field
// count reports the record's first line) and the column (header name; empty for extra fields).
// Bad rows: missing value, not a number (incl. trailing garbage "12abc"), non-integer, zero or
// negative frames/height/width, NaN/inf, a video without fps > 0, an unterminated quote (which
// swallows the rest of the file), a character after a closing quote, wrong field count.
// The file is mmap'ed and scanned once without per-field allocation; files of 32 MB or more are
// parsed by two threads (the second half is kept only where it starts exactly at the record the
// first thread reaches, so ids, lines and errors are those of one sequential pass), and pages are
// released behind the parser (~0.17 s per million rows with captions per core).
Result<Manifest> ReadManifest(const std::string& path, const ManifestOptions& options = {});

// Parses manifest text already in memory; `name` is used in error messages.
Result<Manifest> ParseManifest(std::string_view text, const std::string& name,
                               const ManifestOptions& options = {});

}  // namespace ditscale::balance
