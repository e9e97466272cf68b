// The shape benchmark CSV reader of bench_csv.h.
#include "ditscale/balance/bench_csv.h"

#include <array>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace ditscale::balance {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

std::vector<std::string_view> Split(std::string_view line) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (size_t i = 0; i <= line.size(); ++i) {
    if (i == line.size() || line[i] == ',') {
      out.push_back(Trim(line.substr(start, i - start)));
      start = i + 1;
    }
  }
  return out;
}

// A finite number > 0 (integer-valued when `integer`); nullopt with *why.
std::optional<double> ParsePositive(std::string_view s, bool integer, std::string* why) {
  if (s.empty()) {
    *why = "missing value";
    return std::nullopt;
  }
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(v)) {
    *why = "not a finite number: '" + std::string(s) + "'";
    return std::nullopt;
  }
  if (integer && (v != std::floor(v) || v > 9e15)) {
    *why = "not an integer: '" + std::string(s) + "'";
    return std::nullopt;
  }
  if (v <= 0) {
    *why = "must be > 0, got '" + std::string(s) + "'";
    return std::nullopt;
  }
  return v;
}

enum Column { kB, kS, kT, kM, kK, kNum };
constexpr const char* kNames[kNum] = {"batch_size", "seq_len", "step_time_s", "peak_mem_bytes",
                                      "micro_batches"};
using Columns = std::array<int, kNum>;  // the field index of each column, -1 when absent

// The header row: *col and *header; a failure for a duplicate or missing required column.
std::optional<Failure> ParseHeader(const std::vector<std::string_view>& fields,
                                   const std::string& name, int64_t line_no, Columns* col,
                                   std::vector<std::string>* header) {
  for (size_t i = 0; i < fields.size(); ++i) {
    header->emplace_back(fields[i]);
    for (int k = 0; k < kNum; ++k) {
      if (fields[i] == kNames[k]) {
        if ((*col)[k] >= 0) return Failure::InFile(name, line_no, kNames[k], "duplicate column");
        (*col)[k] = static_cast<int>(i);
      }
    }
  }
  for (int k = 0; k < kM; ++k) {
    if ((*col)[k] < 0) {
      return Failure::InFile(name, line_no, kNames[k],
                             "header lacks required column (need batch_size, seq_len, "
                             "step_time_s[, peak_mem_bytes][, micro_batches])");
    }
  }
  return std::nullopt;
}

// One measurement row into *row (*has_memory: it gives peak_mem_bytes).
std::optional<Failure> ParseRow(const std::vector<std::string_view>& fields, const Columns& col,
                                const std::string& name, int64_t line_no, BenchRow* row,
                                bool* has_memory) {
  std::string why;
  row->line = line_no;
  for (int k = 0; k < kNum; ++k) {
    if (col[k] < 0) continue;
    std::string_view f = fields[col[k]];
    if (k == kM && f.empty()) continue;
    auto v = ParsePositive(f, k == kB || k == kS || k == kK, &why);
    if (!v) return Failure::InFile(name, line_no, kNames[k], why);
    switch (k) {
      case kB:
        row->batch_size = static_cast<int64_t>(*v);
        break;
      case kS:
        row->seq_len = static_cast<int64_t>(*v);
        break;
      case kT:
        row->step_time_s = *v;
        break;
      case kK:
        if (*v > 1e6) {
          return Failure::InFile(
              name, line_no, kNames[k],
              "implausible number of micro-batches (> 1e6): '" + std::string(f) + "'");
        }
        row->micro_batches = static_cast<int64_t>(*v);
        break;
      default:
        row->peak_mem_bytes = *v;
        *has_memory = true;
    }
  }
  return std::nullopt;
}

}  // namespace

Result<BenchTable> ParseBenchCsv(std::string_view text, const std::string& name) {
  BenchTable t;
  t.source = name;
  Columns col;
  col.fill(-1);
  std::vector<std::string> header;
  int64_t line_no = 0;
  size_t pos = 0;
  bool have_header = false;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    std::string_view trimmed = Trim(line);
    if (trimmed.empty() || trimmed.front() == '#') continue;
    auto fields = Split(line);
    if (!have_header) {
      if (auto f = ParseHeader(fields, name, line_no, &col, &header)) return *f;
      have_header = true;
      continue;
    }
    if (fields.size() != header.size()) {
      return Failure::InFile(name, line_no,
                             fields.size() < header.size() ? header[fields.size()] : "",
                             "wrong field count: the row has " + std::to_string(fields.size()) +
                                 " fields, the header has " + std::to_string(header.size()));
    }
    BenchRow row;
    if (auto f = ParseRow(fields, col, name, line_no, &row, &t.has_memory)) return *f;
    t.rows.push_back(row);
  }
  if (!have_header) return Failure::InFile(name, 1, "", "empty benchmark file: no header row");
  return t;
}

Result<BenchTable> ReadBenchCsv(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) {
    return Failure::InFile(path, 0, "", "cannot open benchmark file: no such file");
  }
  if (!std::filesystem::is_regular_file(st)) {
    return Failure::InFile(path, 0, "", "not a regular file (a benchmark CSV is expected)");
  }
  const auto size = std::filesystem::file_size(path, ec);
  if (ec || size > kMaxBenchBytes) {
    return Failure::InFile(
        path, 0, "", "benchmark file larger than " + std::to_string(kMaxBenchBytes >> 20) + " MiB");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Failure::InFile(path, 0, "", "cannot open benchmark file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseBenchCsv(ss.str(), path);
}

}  // namespace ditscale::balance
