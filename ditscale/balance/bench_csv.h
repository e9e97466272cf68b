// The shape benchmark CSV (the measurements `ditscale fit` and fit.h fit the cost model to).
//
// Benchmark CSV: a header row naming the columns batch_size, seq_len, step_time_s and optionally
// peak_mem_bytes and micro_batches (any order; other columns ignored), then one row per
// measurement. Lines that start with '#' and blank lines are ignored. batch_size and seq_len are
// positive integers, step_time_s a positive number of seconds, peak_mem_bytes a positive number
// of bytes or empty, micro_batches k a positive integer (default 1 when the column is absent): the
// row timed one optimizer step made of k forward/backward passes of B samples of S tokens each
// (gradient accumulation), peak memory being that of one pass. Errors are Failures
// "file:line: column 'seq_len': ...".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ditscale/core/result.h"

namespace ditscale::balance {

struct BenchRow {
  int64_t batch_size = 0;     // B, samples per step
  int64_t seq_len = 0;        // S, tokens per sample
  double step_time_s = 0;     // measured step time, s
  double peak_mem_bytes = 0;  // measured peak memory, bytes; 0 when not measured
  int64_t micro_batches = 1;  // k: forward/backward passes of (B, S) in the timed step
  int64_t line = 0;           // 1-based line in the file
};

struct BenchTable {
  std::string source;
  std::vector<BenchRow> rows;
  bool has_memory = false;  // the header has peak_mem_bytes and at least one row gives it
};

// Reads / parses a benchmark CSV (see above). Only regular files of at most kMaxBenchBytes are
// read ("not a regular file" for a directory or a device).
inline constexpr std::size_t kMaxBenchBytes = std::size_t{256} << 20;
Result<BenchTable> ReadBenchCsv(const std::string& path);
Result<BenchTable> ParseBenchCsv(std::string_view text, const std::string& name);

}  // namespace ditscale::balance
