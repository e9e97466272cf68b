// The Parquet manifest reader, and the same reader over an Arrow stream (a pyarrow.Table or a
// datasets.Dataset handed to the Python sampler), through Apache Arrow C++.
//
// Columns: the five required columns of manifest.h, top-level, each once (a repeated or missing
// one is a Failure naming it; other columns are never read). Their Arrow types:
//   path                          string, large_string, string_view, or a dictionary of these
//   num_frames, height, width     any integer or floating-point type (float16/32/64), or a
//                                 dictionary of these
//   fps                           the same as num_frames
// Any other type (bool, binary, decimal, timestamp, list, struct, ...) is a Failure of the whole
// file naming the column and its Arrow type: no row could pass. Each value is then written as the
// text a CSV field would hold (integers in decimal, floats in their shortest round-trip form, so
// 81.0 is 81 and NaN is 'nan') and goes through the field rules of manifest.h (ValidateRow): the
// same messages, the same ranges. A null is a missing value: a bad row for path, num_frames,
// height, width and a video's fps, allowed for an image's fps (an empty CSV field).
//
// Locations: a bad row's Failure has line = its 1-based row number (sample id + 1; there is no
// header line) and the column; file-level failures have line 0. skip_bad_rows as for CSV/JSONL.
//
// Memory: only the required columns are read, one record batch (kParquetBatchRows rows) at a
// time through a buffered stream, so the file never sits in memory as strings; the metadata's
// row count is checked against kMaxRows before anything is reserved. The file must be a regular
// file (Parquet is read from its footer): a directory, pipe or device is refused, a file over
// kMaxFileBytes too. Not a Parquet file, a truncated one, a corrupt footer or page: a Failure
// naming the file with Arrow's words. Never throws (Arrow's exceptions and std::bad_alloc become
// Failures).
//
// Arrow is linked only into the plugin module libditscale_parquet.so (internal/parquet_plugin.h),
// which these functions load on their first call: when it cannot be loaded, every function
// returns a Failure naming the file, the module and why, and ParquetSupported() is false.
// Built without Arrow (DITSCALE_PARQUET=OFF or no Arrow found), every function returns the
// Failure "built without Parquet support ..." naming the file. Either way a stream is left
// untouched, to be released by its owner.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ditscale/balance/manifest.h"
#include "ditscale/core/result.h"

struct ArrowArrayStream;  // the Arrow C stream interface (arrow/c/abi.h)

namespace ditscale::balance::internal {

inline constexpr int64_t kParquetBatchRows = 65536;

// Whether this build reads Parquet (Arrow C++ was found and the reader module loads).
bool ParquetSupported();

// Reads the Parquet file `path`.
Result<Manifest> ReadParquetManifest(const std::string& path, const ManifestOptions& options);

// Parses Parquet file bytes already in memory (the bytes must outlive the call); `name` is used
// in error messages.
Result<Manifest> ParseParquetManifest(std::string_view bytes, const std::string& name,
                                      const ManifestOptions& options);

// Reads the record batches of an Arrow C stream (the same columns, types and rules; rows are
// numbered across batches). The stream is consumed and released (also on failure); `name` is
// used in error messages. A null stream or one already released is a Failure.
Result<Manifest> ReadArrowStreamManifest(ArrowArrayStream* stream, const std::string& name,
                                         const ManifestOptions& options);

}  // namespace ditscale::balance::internal
