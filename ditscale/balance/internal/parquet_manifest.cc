// The functions of parquet_manifest.h: without Arrow (DITSCALE_PARQUET=OFF or none found) a
// Failure saying so; with it, calls into the plugin module (internal/parquet_plugin.h), loaded on
// the first call, so that reading a CSV or JSONL manifest never loads Arrow.
#include "ditscale/balance/internal/parquet_manifest.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "ditscale/balance/internal/parquet_plugin.h"

namespace ditscale::balance::internal {
namespace {

Failure InFile(const std::string& name, std::string message) {
  return Failure::InFile(name, 0, "", std::move(message));
}

#if DITSCALE_HAVE_PARQUET

// The folder of a path ("" for a bare name).
std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

// The table, or the Failure naming the file, the module and why it did not load.
const ParquetReaderTable* Table(const std::string& name, Failure* why) {
  const ParquetPluginLoad& load = ParquetPlugin();
  if (load.table == nullptr) {
    *why = InFile(name, std::string("cannot read Parquet: the reader module ") +
                            kParquetPluginFile + " (Arrow C++) could not be loaded: " + load.error);
  }
  return load.table;
}

#else

Failure NoParquet(const std::string& name) {
  return InFile(name,
                "built without Parquet support: rebuild ditscale where Arrow C++ is found (pyarrow "
                "in the build's Python, or a system Arrow; DITSCALE_PARQUET=AUTO or ON)");
}

#endif

}  // namespace

ParquetPluginLoad LoadParquetPlugin(const std::vector<std::string>& candidates) {
  ParquetPluginLoad out;
  const ParquetReaderTable want = ExpectedParquetLayout();
  for (const std::string& path : candidates) {
    if (!out.error.empty()) out.error += "; ";
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e = dlerror();
      out.error += e != nullptr ? e : path + ": not loaded";
      continue;
    }
    using Get = const ParquetReaderTable* (*)();
    auto get = reinterpret_cast<Get>(dlsym(handle, kParquetPluginSymbol));
    const ParquetReaderTable* t = get != nullptr ? get() : nullptr;
    if (t == nullptr) {
      out.error += path + ": no " + kParquetPluginSymbol;
    } else if (t->version != want.version || t->manifest_size != want.manifest_size ||
               t->options_size != want.options_size || t->result_size != want.result_size) {
      out.error += path + ": built for another version of ditscale (table layout differs)";
    } else {
      out.table = t;
      out.error.clear();
      return out;
    }
    dlclose(handle);
  }
  if (candidates.empty()) out.error = "no place to look for it";
  return out;
}

std::vector<std::string> ParquetPluginCandidates() {
  if (const char* env = std::getenv("DITSCALE_PARQUET_PLUGIN"); env != nullptr && *env != '\0') {
    return {env};
  }
  std::vector<std::string> out;
#if DITSCALE_HAVE_PARQUET
  auto add = [&](const std::string& dir) {
    const std::string p = dir + kParquetPluginFile;
    for (const std::string& q : out) {
      if (q == p) return;
    }
    out.push_back(p);
  };
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ParquetPluginCandidates), &info) != 0 &&
      info.dli_fname != nullptr && std::string(info.dli_fname).find('/') != std::string::npos) {
    add(DirOf(info.dli_fname));
    if (char* real = realpath(info.dli_fname, nullptr)) {
      add(DirOf(real));
      free(real);
    }
  }
#ifdef DITSCALE_PARQUET_PLUGIN_DIR
  add(std::string(DITSCALE_PARQUET_PLUGIN_DIR) + "/");
#endif
#endif
  return out;
}

const ParquetPluginLoad& ParquetPlugin() {
  static const ParquetPluginLoad load = LoadParquetPlugin(ParquetPluginCandidates());
  return load;
}

#if !DITSCALE_HAVE_PARQUET

bool ParquetSupported() { return false; }
Result<Manifest> ReadParquetManifest(const std::string& path, const ManifestOptions&) {
  return NoParquet(path);
}
Result<Manifest> ParseParquetManifest(std::string_view, const std::string& name,
                                      const ManifestOptions&) {
  return NoParquet(name);
}
Result<Manifest> ReadArrowStreamManifest(ArrowArrayStream*, const std::string& name,
                                         const ManifestOptions&) {
  return NoParquet(name);
}

#else

bool ParquetSupported() { return ParquetPlugin().table != nullptr; }

Result<Manifest> ReadParquetManifest(const std::string& path, const ManifestOptions& options) {
  Failure why;
  const ParquetReaderTable* t = Table(path, &why);
  if (t == nullptr) return why;
  return t->read_file(path, options);
}

Result<Manifest> ParseParquetManifest(std::string_view bytes, const std::string& name,
                                      const ManifestOptions& options) {
  Failure why;
  const ParquetReaderTable* t = Table(name, &why);
  if (t == nullptr) return why;
  return t->parse_bytes(bytes, name, options);
}

Result<Manifest> ReadArrowStreamManifest(ArrowArrayStream* stream, const std::string& name,
                                         const ManifestOptions& options) {
  Failure why;
  const ParquetReaderTable* t = Table(name, &why);
  if (t == nullptr) return why;  // the stream is left to its owner, as without Arrow
  return t->read_stream(stream, name, options);
}

#endif

}  // namespace ditscale::balance::internal
