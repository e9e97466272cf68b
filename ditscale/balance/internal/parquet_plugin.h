// The Parquet reader as a plugin: Arrow C++ (libarrow, libparquet: tens of MB, ~10-40 ms of
// dynamic loading and static initialisers) is linked only into the shared module
// libditscale_parquet.so (ditscale/balance/parquet/arrow_reader.cc), which the functions of
// parquet_manifest.h load with dlopen the first time a Parquet file or an Arrow stream is read.
// A CSV or JSONL run never loads Arrow.
//
// The module and the library that loads it come from one build (C++ types cross the boundary):
// its table carries the layout it was built with and a different one is refused.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ditscale/balance/manifest.h"
#include "ditscale/core/result.h"

struct ArrowArrayStream;

namespace ditscale::balance::internal {

// The file name of the module, and its one exported symbol: a function returning the table.
inline constexpr char kParquetPluginFile[] = "libditscale_parquet.so";
inline constexpr char kParquetPluginSymbol[] = "ditscale_parquet_reader_table";

struct ParquetReaderTable {
  // The layout check: kParquetTableVersion and the sizes of the types passed by reference.
  uint32_t version;
  uint32_t manifest_size, options_size, result_size;
  Result<Manifest> (*read_file)(const std::string& path, const ManifestOptions& options);
  Result<Manifest> (*parse_bytes)(std::string_view bytes, const std::string& name,
                                  const ManifestOptions& options);
  Result<Manifest> (*read_stream)(ArrowArrayStream* stream, const std::string& name,
                                  const ManifestOptions& options);
};
inline constexpr uint32_t kParquetTableVersion = 1;

// The table of this build's layout, to compare against a loaded one.
inline ParquetReaderTable ExpectedParquetLayout() {
  return ParquetReaderTable{kParquetTableVersion, sizeof(Manifest), sizeof(ManifestOptions),
                            sizeof(Result<Manifest>), nullptr, nullptr, nullptr};
}

// The outcome of loading the module: the table, or why not (every path tried and the loader's
// words, e.g. "libarrow.so.2600: cannot open shared object file").
struct ParquetPluginLoad {
  const ParquetReaderTable* table = nullptr;
  std::string error;
};

// Tries `candidates` (paths of the module) in order; the first that loads and has a table of
// this build's layout wins. The modules stay loaded. Not cached (see ParquetPlugin).
ParquetPluginLoad LoadParquetPlugin(const std::vector<std::string>& candidates);

// The default candidates: $DITSCALE_PARQUET_PLUGIN when set (only it), else the module beside
// the binary holding this code (the Python extension, installed beside it), the same after
// resolving symbolic links, and the build tree's lib folder.
std::vector<std::string> ParquetPluginCandidates();

// LoadParquetPlugin(ParquetPluginCandidates()), once per process (thread-safe).
const ParquetPluginLoad& ParquetPlugin();

}  // namespace ditscale::balance::internal
