// A manifest read straight into its shapes; see shaped_reader.h. CSV: the parts of
// internal/csv_manifest.cc carry local shape indices (internal/shape_mapper.h); they are joined
// here: the parts' shapes merged and sorted, every index rewritten to the sorted list (the
// counts taken on the way) on this thread while a second one writes the ids.
#include "ditscale/balance/shaped_reader.h"

#include <new>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "ditscale/balance/internal/csv_manifest.h"
#include "ditscale/balance/internal/manifest_file.h"
#include "ditscale/balance/internal/manifest_rows.h"
#include "ditscale/balance/internal/shape_mapper.h"
#include "ditscale/core/error.h"

namespace ditscale::balance {
namespace {

using internal::RowSink;

// From this many samples on, the ids are written on a second thread.
constexpr int64_t kParallelSamples = int64_t{1} << 17;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Whether ReadManifest parses `path` as CSV: the format of the options, else of the extension
// (.jsonl / .json / .parquet / .pq are not CSV).
bool IsCsv(const std::string& path, const ManifestOptions& options) {
  if (!options.format.empty()) return options.format == "csv";
  for (std::string_view ext : {".jsonl", ".json", ".parquet", ".pq"}) {
    if (EndsWith(path, ext)) return false;
  }
  return true;
}

// The first sample a part's mapper refused, in row order: the error ShapeManifest throws.
void ThrowFirstRefusal(const std::vector<RowSink>& parts, const std::string& source) {
  int64_t row_offset = 0;
  for (const RowSink& p : parts) {
    if (const int64_t e = p.mapper->error_entry(); e >= 0) {
      throw Error(source + ": sample id " + std::to_string(p.id_of(e) + row_offset) + ": " +
                  p.mapper->error());
    }
    row_offset += p.rows;
  }
}

// The good rows' global ids, part after part.
std::vector<int64_t> JoinIds(const std::vector<RowSink>& parts, int64_t n) {
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(n));
  int64_t row_offset = 0;
  for (const RowSink& p : parts) {
    if (p.dense_ids) {
      for (int64_t k = 0; k < p.good(); ++k) ids.push_back(k + row_offset);
    } else {
      for (int64_t id : p.ids) ids.push_back(id + row_offset);
    }
    row_offset += p.rows;
  }
  return ids;
}

// The parts (checked by CheckParts, every one with a mapper) joined into one ShapedManifest.
ShapedManifest JoinShaped(std::vector<RowSink>* parts, const std::string& source) {
  ThrowFirstRefusal(*parts, source);
  std::vector<const std::vector<TrainShape>*> lists;
  int64_t n = 0;
  for (const RowSink& p : *parts) {
    lists.push_back(&p.mapper->shapes());
    n += p.good();
  }
  internal::MergedShapes merged = internal::MergeShapes(lists);
  ShapedManifest out;
  out.ids_dense = true;  // the ids are 0..n-1 unless some part skipped a row
  for (const RowSink& p : *parts) out.ids_dense = out.ids_dense && p.dense_ids;
  auto write_ids = [&] { out.ids = JoinIds(*parts, n); };
  std::jthread ids_worker;
  if (out.ids_dense) {
    // nothing to write
  } else if (n >= kParallelSamples && std::thread::hardware_concurrency() >= 2) {
    ids_worker = std::jthread(write_ids);
  } else {
    write_ids();
  }
  // The first part's array (reserved for the whole file) becomes shape_of when it is large
  // enough; each part's local indices are rewritten to the sorted list's.
  RowSink& first = parts->front();
  if (first.shape_of.capacity() >= static_cast<size_t>(n)) {
    out.shape_of = std::move(first.shape_of);
  } else {
    out.shape_of.reserve(static_cast<size_t>(n));
    out.shape_of.assign(first.shape_of.begin(), first.shape_of.end());
    std::vector<int32_t>().swap(first.shape_of);
  }
  out.shape_of.resize(static_cast<size_t>(n));
  out.count.assign(merged.shapes.size(), 0);
  int32_t* dst = out.shape_of.data();
  for (size_t k = 0; k < parts->size(); ++k) {
    const int32_t* src = k == 0 ? dst : (*parts)[k].shape_of.data();
    const int32_t* to = merged.to_global[k].data();
    const int64_t good = (*parts)[k].good();
    for (int64_t i = 0; i < good; ++i) {
      const int32_t s = to[src[i]];
      dst[i] = s;
      ++out.count[s];
    }
    dst += good;
    if (k > 0) std::vector<int32_t>().swap((*parts)[k].shape_of);
  }
  out.shapes = std::move(merged.shapes);
  if (ids_worker.joinable()) ids_worker.join();
  return out;
}

}  // namespace

namespace internal {

Result<ShapedManifest> ShapeCsvText(std::string_view text, const std::string& name,
                                    const ModelPreset& model, const ManifestOptions& options,
                                    const CsvParseOptions& csv, Manifest* rows) {
  const BucketChooser chooser(model);
  auto parts = ParseCsvRows(text, name, options, csv, &chooser);
  if (!parts.ok()) return parts.failure();
  if (auto f = CheckParts(*parts, name, options, rows)) return *f;
  return JoinShaped(&*parts, name);
}

}  // namespace internal

Result<ShapedManifest> ReadShapedManifest(const std::string& path, const ModelPreset& model,
                                          const ManifestOptions& options, Manifest* rows) {
  if (!IsCsv(path, options)) {
    Result<Manifest> m = ReadManifest(path, options);
    if (!m.ok()) return m.failure();
    ShapedManifest shaped = ShapeManifest(std::move(*m), model);
    rows->source = m->source;
    rows->rows_total = m->rows_total;
    rows->rows_skipped = m->rows_skipped;
    rows->skipped_examples = std::move(m->skipped_examples);
    return shaped;
  }
  try {
    internal::ManifestFile file;
    if (auto err = file.Open(path)) return *err;
    internal::CsvParseOptions csv;
    csv.release_pages = file.file_mapped();  // as ReadManifest: the file never counts whole in RSS
    return internal::ShapeCsvText(file.text(), path, model, options, csv, rows);
  } catch (const std::bad_alloc&) {
    return Failure{"out of memory while reading the manifest", path, 0, ""};
  }
}

}  // namespace ditscale::balance
