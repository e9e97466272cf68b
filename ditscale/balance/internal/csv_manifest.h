// The CSV manifest reader (see manifest.h for the format and the error rules).
//
// Large files are parsed by two threads: the data rows are split in the middle; the second
// thread counts the quotes before the split (their parity tells whether the split falls inside a
// quoted field), starts at the first line end outside quotes after it, and parses from there
// while the first thread parses up to that point. The second part is used only if the first
// thread's parse, which is authoritative, ends exactly at that line end; otherwise (a quote
// inside an unquoted field, an unterminated quote, a blank line or lone '\r' there) the first
// thread simply continues. Results, ids, line numbers and error messages are therefore always
// those of a single sequential pass.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "ditscale/balance/internal/manifest_rows.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/core/result.h"

namespace ditscale::balance::internal {

struct CsvParseOptions {
  // Texts of at least this many bytes are parsed on two threads (when 2+ cores are available).
  size_t min_parallel_bytes = size_t{32} << 20;
  // Force two threads regardless of the core count (tests).
  bool force_parallel = false;
  // The text is a private read-only file mapping: pages already parsed are dropped from the
  // process (madvise MADV_DONTNEED) so that peak RSS does not include the whole file.
  bool release_pages = false;
  // The one-pass split of quote-free one-line records (CsvScanner::PlainRecord); false: every
  // record through the general field scanner (tests: both give the same result).
  bool plain_fast_path = true;
};

// The data rows of CSV manifest text as parts in file order (one, or two when parsed on two
// threads; each part's line_offset set), for Finish or the fused shape mapping
// (shaped_reader.h): with `chooser` the rows are mapped to local shape indices as they are
// parsed (RowSink). Failure: an empty text or a bad header; `name` is used in messages.
Result<std::vector<RowSink>> ParseCsvRows(std::string_view text, const std::string& name,
                                          const ManifestOptions& options,
                                          const CsvParseOptions& csv = {},
                                          const BucketChooser* chooser = nullptr);

// Parses CSV manifest text (ParseCsvRows, then Finish); `name` is used in error messages.
Result<Manifest> ParseCsvManifest(std::string_view text, const std::string& name,
                                  const ManifestOptions& options, const CsvParseOptions& csv = {});

}  // namespace ditscale::balance::internal
