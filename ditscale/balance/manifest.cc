// Manifest reading: the file is opened within the limits by internal/manifest_file.cc; CSV is
// parsed by internal/csv_manifest.cc, JSONL by internal/jsonl_manifest.cc; rows are validated and
// collected by internal/manifest_rows.cc. Parquet files are opened and read by
// internal/parquet_manifest.cc (through Arrow), rows validated the same way.
#include "ditscale/balance/manifest.h"

#include <new>
#include <string_view>

#include "ditscale/balance/internal/csv_manifest.h"
#include "ditscale/balance/internal/jsonl_manifest.h"
#include "ditscale/balance/internal/manifest_file.h"
#include "ditscale/balance/internal/parquet_manifest.h"

namespace ditscale::balance {
namespace {

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The format of options (or, when empty, of the name's extension).
std::string FormatOf(const std::string& name, const ManifestOptions& options) {
  if (!options.format.empty()) return options.format;
  if (EndsWith(name, ".parquet") || EndsWith(name, ".pq")) return "parquet";
  return EndsWith(name, ".jsonl") || EndsWith(name, ".json") ? "jsonl" : "csv";
}

Result<Manifest> Parse(std::string_view text, const std::string& name,
                       const ManifestOptions& options, const internal::CsvParseOptions& csv) {
  const std::string format = FormatOf(name, options);
  if (format == "csv") return internal::ParseCsvManifest(text, name, options, csv);
  if (format == "jsonl") return internal::ParseJsonlManifest(text, name, options);
  if (format == "parquet") return internal::ParseParquetManifest(text, name, options);
  return Failure{"unknown manifest format '" + format + "' (use csv, jsonl or parquet)", name, 0,
                 ""};
}

Failure OutOfMemory(const std::string& name) {
  return Failure{"out of memory while reading the manifest", name, 0, ""};
}

}  // namespace

Result<Manifest> ParseManifest(std::string_view text, const std::string& name,
                               const ManifestOptions& options) {
  try {
    return Parse(text, name, options, {});
  } catch (const std::bad_alloc&) {
    return OutOfMemory(name);
  }
}

Result<Manifest> ReadManifest(const std::string& path, const ManifestOptions& options) {
  try {
    // Parquet is read from its footer, column by column: the file is not mapped as text.
    if (FormatOf(path, options) == "parquet") return internal::ReadParquetManifest(path, options);
    internal::ManifestFile file;
    if (auto err = file.Open(path)) return *err;
    // The CSV parser drops the mapping's pages behind it: the file never counts whole in RSS.
    internal::CsvParseOptions csv;
    csv.release_pages = file.file_mapped();
    return Parse(file.text(), path, options, csv);
  } catch (const std::bad_alloc&) {
    return OutOfMemory(path);
  }
}

}  // namespace ditscale::balance
